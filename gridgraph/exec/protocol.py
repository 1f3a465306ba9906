"""What clients and workers say to each other: topics, message kinds, error codes, size caps.

Both runtimes (client/, worker/) and every transport (ipfs/) name topics and read codes
from here, so neither runtime imports the other and no transport parses a runtime's strings.

Topics: a worker hears requests on `worker_topic(name)`; a client session hears its replies
on `client_topic(identity, session)`, which no request names; workers announce themselves on
DISCOVERY_TOPIC (IPFS only, the one topic sent in the clear).

Acknowledgements: every request carries `ack`, what its client no longer needs a reply to
from that worker (received, or given up): `{"below": n, "ids": [m, ...]}`, every request
whose id (`request_number`) is under n, and the ids listed (at most MAX_ACK_IDS, all at least
n). A worker keeps each reply until it is acknowledged (worker/session.py), and refuses as
already served a request under `below` it has no record of: an old copy the transport
delivered late.

Order: a run request carries `after`, the id number of the run its client sent the same
worker before it (0 for its first). A worker queues a run only once that one is recorded
there or acknowledged, so a session's runs are served in the order they were sent, whatever
order the transport delivers them in (worker/session.py `held`).

Caps: every string a peer chooses that a worker keeps has a length limit here, so that what
it keeps is counted against someone (a session's records, its named peers, an inbox key).
"""

from __future__ import annotations

from typing import Any

DISCOVERY_TOPIC = "gridgraph.discovery"
_WORKER_PREFIX = "gridgraph.worker."
_CLIENT_PREFIX = "gridgraph.client."

# Requests a client sends a worker: each gets exactly one reply. (The other messages a worker
# hears: "transfer" from another worker, "resend" asking for one again, "abort" of a run.)
REQUEST_KINDS = frozenset({"put", "run", "free", "stats", "seed", "bye", "ping"})

# Error codes an error reply may carry ("refused" when none is more specific).
REFUSED = "refused"
LIMIT = "limit"  # over a memory, time or rate limit of the worker
UNKNOWN_PLAN = "unknown-plan"  # the worker no longer keeps the program: send it again
ALREADY_SERVED = "already-served"  # the request ran; its reply is no longer kept
SESSION_ENDED = "session-ended"  # the worker ended the session (bye, lease, eviction)
SESSION_LOST = "session-lost"  # its executor died: what the session held is gone
SESSION_GONE = frozenset({SESSION_LOST, SESSION_ENDED})

# Lengths of the strings a peer chooses that a worker keeps (characters).
MAX_SESSION_ID = 64  # a client's are 12; kept in its session's key
MAX_REQUEST_ID = 64  # a client's are a few hex digits; kept in its session's records
MAX_CLIENT_KEY = 1024  # identity (an IPFS one is ~110 characters) / session id
MAX_NAME = 256  # a worker name or identity a run names (IPFS identities: ~100)

MAX_ACK_IDS = 64  # request ids a request acknowledges one by one, above its watermark


def request_number(rid: str) -> int | None:
    """The number a request id spells (a client's ids are consecutive numbers in lowercase
    hex: "1", "2", ... "a"), or None for an id spelt any other way, which no
    acknowledgement watermark covers."""
    if not 0 < len(rid) <= 16 or rid[0] == "0" or not all(c in "0123456789abcdef" for c in rid):
        return None
    return int(rid, 16)


def worker_topic(name: str) -> str:
    """Where worker `name` hears requests and transfers."""
    return f"{_WORKER_PREFIX}{name}"


def client_topic(identity: str, session: str) -> str:
    """Where a client session hears its replies: workers reply there and nowhere else."""
    return f"{_CLIENT_PREFIX}{identity}.{session}"


def worker_of_topic(topic: str) -> str | None:
    """The worker name a worker topic is for, or None for any other topic."""
    return topic[len(_WORKER_PREFIX) :] if topic.startswith(_WORKER_PREFIX) else None


def client_of_topic(topic: str) -> str | None:
    """The client identity a client topic is for, or None for any other topic."""
    if not topic.startswith(_CLIENT_PREFIX):
        return None
    return topic[len(_CLIENT_PREFIX) :].partition(".")[0]


def is_name(value: Any) -> bool:
    """Whether a run may name `value` as a worker or as a worker's identity: a string of 1
    to MAX_NAME characters. Each is kept a while (with the session, with the transfers kept
    for resending, on IPFS in the transport's key caches), counted in no one's memory."""
    return isinstance(value, str) and 0 < len(value) <= MAX_NAME
