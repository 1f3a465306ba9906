"""One client session on a worker: everything the worker keeps for it, and its memory.

A client is an authenticated peer plus the session id it chose; everything a worker keeps
for it lives in its `Session` and nowhere else, so no other peer can read, evict, reseed or
reset any of it:

    work       what its programs run on: tensors, prepared programs, random stream
               (workspace.py; with isolation, the one in its executor process counts)
    records    request id -> its reply once sent: a request id runs at most once. Replies are
               kept for the REPLIES_KEPT latest requests, bare ids for the RECORDS_KEPT latest
    reply_topic  where its client hears replies (protocol.client_topic of the sender)
    traffic    messages and bytes the worker sent for it
    sent       transfers it sent, kept for resending (ipfs) to the identity they went to
    inbox      transfers sent to it, by (run, first value id, sending worker) and sender
               identity, as received (decoded only when a run takes one); charged to the
               session when its runs named the sender (`named`), else to the sender
    queue      its requests waiting to run, in arrival order (`queued_bytes` of them)

All of it counts against the session's memory limit (`memory()`), and all of it goes when the
client says `bye` or its lease expires; `EndedSessions` remembers why a session ended. How a
request is served: run.py.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any

from gridgraph.exec.protocol import SESSION_LOST, is_name
from gridgraph.exec.safety.droplog import DropLog
from gridgraph.exec.safety.limits import (
    RECORD_BYTES,
    TRANSFER_BYTES,
)
from gridgraph.exec.transport import TrafficCounter
from gridgraph.exec.worker.workspace import Workspace

log = logging.getLogger("gridgraph.worker")
_drops = DropLog(log)

NAMED_KEPT = 256  # identities of workers a session's runs named, the latest kept
REPLIES_KEPT = 16  # latest replies kept per session, to answer a resent request again
RECORDS_KEPT = 100_000  # latest request ids remembered per session (~RECORD_BYTES each)
TRANSFERS_KEPT = 1024  # ipfs: transfers kept per session for resending, and received ids
# Ended sessions remembered (EndedSessions): per peer, and peers, the latest ones.
ENDED_KEPT = 64
ENDED_PEERS = 1024


class RequestError(Exception):
    """A request that cannot be served; its message goes back to the sender."""

    def __init__(self, message: str, code: str = "refused") -> None:
        super().__init__(message)
        self.code = code


class ExecutorLost(Exception):
    """A session's executor process is gone, and what it held with it; `str(e)` says why."""

    code = SESSION_LOST


class Record:
    """What a session remembers of one request: its reply once sent, and when it went out."""

    __slots__ = ("reply", "sent_at", "resent")

    def __init__(self) -> None:
        self.reply: bytes | None = None  # None: queued or running, or the reply was dropped
        self.sent_at = math.inf  # monotonic time the reply went out (inf until it did)
        self.resent = 0  # times the reply was sent again (worker.RESENDS at most)


class Session:
    """Everything a worker keeps for one client; see the module docstring."""

    def __init__(self, key: str, peer: str) -> None:
        self.key, self.peer = key, peer
        # Where its client hears replies (worker.client_topic of the sender and session id of
        # its requests): set by the worker when it accepts one, never named by a request.
        self.reply_topic = ""
        # The identity whose transfer opened it, until its client's first request (worker.py)
        self.opened_by: str | None = None
        self.work = Workspace()
        self.records: OrderedDict[str, Record] = OrderedDict()
        self.traffic = TrafficCounter()
        # (run, first value id, receiving worker) -> [its identity, the transfer, resends]
        self.sent: OrderedDict[tuple[int, int, str], list] = OrderedDict()
        # (run, first value id, sending worker) -> sender's identity -> the message received
        self.inbox: dict[tuple[int, int, str], dict[str, bytes]] = {}
        # Identities its runs named as workers (`peers`), the NAMED_KEPT latest: what they
        # send it is its own data, charged to it. What others send is charged to its sender
        # (worker.py): no one else's transfers use up this session's memory.
        self.named: OrderedDict[str, None] = OrderedDict()
        self.stray: set[tuple[tuple[int, int, str], str]] = set()  # (key, sender) not named
        self.release_stray: Callable[[str, int], None] = lambda sender, nbytes: None
        self.received: OrderedDict[tuple[int, int, str], None] = OrderedDict()
        self.aborted: OrderedDict[Any, None] = OrderedDict()  # runs the client gave up on
        # (request, or None until served if it came while others waited; arrival; payload)
        self.queue: deque[tuple[dict | None, float, bytes]] = deque()
        self.queued_bytes = 0  # of the payloads in `queue`
        self.busy = False  # a request is queued or running
        self.serving = False  # a thread serves the queue (running, or waiting for more)
        self.closed = False
        self.last_seen = time.monotonic()
        self.cv = threading.Condition()  # guards inbox, received, aborted, closed
        # the process running its programs (isolation/executor.py), if any
        self.executor: Any = None
        self.elsewhere = 0  # bytes the other process (worker or executor) holds for it
        self._reply_bytes = 0
        self._with_reply: deque[Record] = deque()  # records holding a reply, oldest first
        self._inbox_bytes = 0
        self._sent_bytes = 0

    # --- memory ----------------------------------------------------------------------------

    def memory(self) -> int:
        """Bytes this session holds: its workspace, inbox, kept transfers, replies, records,
        and what the other process (worker or executor) holds for it."""
        return (
            self.work.memory()
            + self._inbox_bytes
            + self._sent_bytes
            + self._reply_bytes
            + RECORD_BYTES * len(self.records)
            + self.elsewhere
        )

    # --- request records -------------------------------------------------------------------

    def record(self, rid: str) -> Record:
        """A new record for request `rid`, dropping the oldest ones past the caps."""
        rec = self.records[rid] = Record()
        while len(self.records) > RECORDS_KEPT:
            _, old = self.records.popitem(last=False)
            self._reply_bytes -= len(old.reply or b"")
            old.reply = None
        return rec

    def replied(self, rec: Record, reply: bytes) -> None:
        """Keep `reply` for resends; only the REPLIES_KEPT latest replies stay (a queue of
        the records holding one, so this costs the same after a million requests)."""
        rec.reply = reply
        self._reply_bytes += len(reply)
        self._with_reply.append(rec)
        while len(self._with_reply) > REPLIES_KEPT:
            old = self._with_reply.popleft()
            if old.reply is not None:
                self._reply_bytes -= len(old.reply)
                old.reply = None

    # --- transfers -------------------------------------------------------------------------

    def keep_sent(
        self, key: tuple[int, int, str], peer: str, payload: bytes, cap: int | None = None
    ) -> None:
        """Keep a transfer this session sent to identity `peer`, for a resend (ipfs): the
        TRANSFERS_KEPT latest, within the room the rest of the session's memory leaves
        under `cap` (None: no limit). The oldest go first; one larger than that room is not
        kept (it cannot be sent again)."""
        _, old, _ = self.sent.pop(key, ("", b"", 0))
        self._sent_bytes -= len(old)
        room = None if cap is None else cap - (self.memory() - self._sent_bytes)
        if room is not None and len(payload) > room:
            return
        self.sent[key] = [peer, payload, 0]
        self._sent_bytes += len(payload)
        while len(self.sent) > TRANSFERS_KEPT or room is not None and self._sent_bytes > room:
            _, (_, dropped, _) = self.sent.popitem(last=False)
            self._sent_bytes -= len(dropped)

    def name_workers(self, identities: Any) -> None:
        """Identities a run of this session named for its workers. What a run may not name
        (`is_name`) is not kept: the run is refused for it (`_peers`)."""
        for identity in identities:
            if is_name(identity):
                self.named[identity] = None
                self.named.move_to_end(identity)
        while len(self.named) > NAMED_KEPT:
            self.named.popitem(last=False)

    def deliver(
        self, key: tuple[int, int, str], sender: str, payload: bytes, stray: bool = False
    ) -> bool:
        """A transfer message arrived from identity `sender` (`payload` as received, checked);
        wake a waiting recv. Kept per sender: one from another identity cannot take its
        place. `stray`: from an identity no run of the session named, charged to that
        sender (the caller did) and not to the session. False if it was not kept."""
        with self.cv:
            got = self.inbox.get(key, {})
            if key in self.received or sender in got or self.closed:
                return False  # ipfs: a resent copy of one already here or used
            got[sender] = payload
            self.inbox[key] = got
            if stray:
                self.stray.add((key, sender))
            else:
                self._inbox_bytes += len(payload) + TRANSFER_BYTES
            self.cv.notify_all()
            return True

    def inbox_fits(self, payload: bytes, cap: int | None) -> bool:
        """Whether keeping `payload` in the inbox (charged as `deliver` charges it) leaves
        this session within `cap` bytes (None: no limit)."""
        return cap is None or self.memory() + len(payload) + TRANSFER_BYTES <= cap

    def has_transfer(self, key: tuple[int, int, str], sender: str) -> bool:
        """Whether identity `sender`'s transfer `key` is here (the caller holds `cv`)."""
        return sender in self.inbox.get(key, ())

    def take(self, key: tuple[int, int, str], sender: str) -> bytes:
        """Remove and return identity `sender`'s transfer `key` as received, and drop the
        ones other identities sent under that key (the caller holds `cv`)."""
        got = self.inbox.pop(key)
        for who, p in got.items():
            self._uncharge(key, who, p)
        payload = got.pop(sender)
        for other in got:
            _drops.warning(other, "client %s: dropped a transfer claiming to come from %s: "
                           "sent by %s, not by the identity its run names", self.key, key[2],
                           other)  # fmt: skip
        self.received[key] = None
        while len(self.received) > TRANSFERS_KEPT:
            self.received.popitem(last=False)
        return payload

    def _uncharge(self, key: tuple[int, int, str], sender: str, payload: bytes) -> None:
        """Stop charging a transfer that leaves the inbox, to whoever it was charged to."""
        if (key, sender) in self.stray:
            self.stray.discard((key, sender))
            self.release_stray(sender, len(payload) + TRANSFER_BYTES)
        else:
            self._inbox_bytes -= len(payload) + TRANSFER_BYTES

    def abort(self, run: Any) -> None:
        if type(run) is not int:
            return
        with self.cv:
            self.aborted[run] = None
            while len(self.aborted) > TRANSFERS_KEPT:
                self.aborted.popitem(last=False)
            self.cv.notify_all()

    # --- end -------------------------------------------------------------------------------

    def end_if_idle(self) -> bool:
        """Mark this session ended, unless a request of it waits or runs (then False). From
        then on its requests are refused (the worker checks `closed`); `close` frees the
        rest."""
        with self.cv:
            if self.busy:
                return False
            self.closed = True
            return True

    def close(self) -> int:
        """Free everything this session holds; returns the number of tensors freed."""
        with self.cv:
            self.closed = True
            for key, got in self.inbox.items():
                for sender, payload in got.items():
                    self._uncharge(key, sender, payload)
            self.inbox.clear()
            self.cv.notify_all()
        n = self.work.clear()
        if self.executor is not None:
            self.executor.close()
        self.records.clear()
        self._with_reply.clear()
        self.sent.clear()
        self.queue.clear()
        self.queued_bytes = 0
        self._reply_bytes = self._inbox_bytes = self._sent_bytes = 0
        return n


class EndedSessions:
    """Why sessions ended, by key: ENDED_KEPT per peer (a peer's own churn pushes out only
    its own), for the ENDED_PEERS peers that most recently lost one. A worker keeps two: why
    it ended sessions their clients had used (lease, eviction), and which ones their clients
    ended (bye), apart, so that a peer's byes never push out why the worker ended one of its
    sessions. Sessions opened by a transfer and never adopted leave no record."""

    def __init__(self) -> None:
        self._by_peer: OrderedDict[str, OrderedDict[str, str]] = OrderedDict()

    def add(self, session: Session, why: str) -> None:
        if session.opened_by:  # opened by a transfer, never used by its client
            return
        kept = self._by_peer.pop(session.peer, None) or OrderedDict()
        self._by_peer[session.peer] = kept  # the most recent peer last
        kept[session.key] = why
        if len(kept) > ENDED_KEPT:
            kept.popitem(last=False)
        if len(self._by_peer) > ENDED_PEERS:
            self._by_peer.popitem(last=False)

    def why(self, peer: str, key: str) -> str | None:
        kept = self._by_peer.get(peer)
        return kept.get(key) if kept is not None else None
