"""`Transport` over one Kubo node: PubSub for messages, raw blocks for large payloads.

`IpfsTransport` moves plaintext (the transport's own tests, raw benches); `GridTransport`, what
gridgraph runs on, seals every message end to end for one endpoint (secure.py);
`WorkerTransport` adds a worker's size limit. State: per topic, its handlers, `pubsub/sub`
stream and reader thread; the block payloads in flight per sending peer; for `GridTransport`,
the large payloads kept for resending (STORED_KEPT) and ids of those received (DELIVERED_KEPT).

Policy:
- a payload over INLINE_MAX travels as BLOCK_SIZE blocks that its message names: under
  go-libp2p-pubsub's 1 MiB message cap (it drops larger ones silently) and the block cap;
- nothing is opened before it is worth opening (`_refusal`, on the reader thread): a
  message from a peer not in `allow` (sealed: not on the discovery topic, unless
  `closed_discovery`), over its topic's size (MAX_ANNOUNCEMENT on the discovery topic, open
  to every peer; MAX_ACK on an ack topic: longer lines are not even parsed, kubo.py) or over
  its node's rate of messages on the topic (DISCOVERY_RATE, MESSAGE_RATE) is dropped, and
  what is opened is decoded with caps on its containers (wire.unpackb);
- the reader thread never waits on the network (`_receive`): block payloads are fetched by
  ASSEMBLERS assemblers, shared fairly among the sending peers (`_admit`: at most
  PENDING_PER_PEER each, and never more than `budget.fair_share` of them while others wait;
  more are dropped, and resent), their declared bytes charged to the sending peer in the
  memory `budget` while fetched, FETCH_WINDOW blocks at a time, delivered whole or dropped at
  the first block not fetched within `fetch_timeout` s: bogus CIDs cost only their sender's
  share;
- sealed (`GridTransport`): for `to`, else for the endpoint the topic names; topics on the
  wire are hashes (but the discovery topic, read by all); blocks hold ciphertext only; a peer
  not in `allow` is dropped before anything is opened;
- a receiver removes its copies of a payload's blocks, opened or not (`_release`: but a
  same-node sender's), and acks; the sender then removes its own, else at eviction or `close()`;
- a malformed or unopenable message, an unfetched block or a failing handler is logged (a
  bounded number of lines, safety/droplog.py) and dropped; a broken stream is reopened until
  `close()`; a node's own publications are skipped unless `deliver_own`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Protocol

import msgpack

from gridgraph.exec import wire
from gridgraph.exec.ipfs import secure
from gridgraph.exec.ipfs.kubo import MAX_BLOCK_SIZE, Kubo, KuboError, Subscription
from gridgraph.exec.ipfs.progress import Progress
from gridgraph.exec.protocol import DISCOVERY_TOPIC, client_of_topic, worker_of_topic
from gridgraph.exec.safety.budget import MemoryBudget, fair_share
from gridgraph.exec.safety.droplog import DropLog
from gridgraph.exec.safety.limits import RateLimiter
from gridgraph.exec.transport import Handler, Transport

log = logging.getLogger(__name__)


class WorkerNames(Protocol):
    """Which endpoint owns a worker name (discovery.Directory, which a client sets)."""

    def identity(self, name: str, wait: float = 0.0) -> str | None:
        """The identity of worker `name`, waiting up to `wait` s to hear of it; None if
        unknown."""

    def heard(self, identity: str) -> None:
        """A message sealed by endpoint `identity` was opened: it is alive."""


ENVELOPE_VERSION = 1
INLINE_MAX = 256 * 1024
BLOCK_SIZE = 512 * 1024
ASSEMBLERS = 32  # block payloads fetched at once, each on an assembler of its own
PENDING_PER_PEER = 4  # of them, from one sending peer; more are dropped (and sent again)
FETCH_WINDOW = 8  # blocks of one payload fetched at once
REMOVE_TRIES = 3  # `block rm` calls before a failure to remove blocks is logged
PUT_PARALLELISM = 8  # blocks stored at once
MAX_PAYLOAD = 1 << 30  # a worker fetches no message larger than this (bytes)
STORED_KEPT = 16  # large payloads whose blocks a transport keeps, for resending
ACK_COPIES = 2  # PubSub drops ~1% of messages: a lost ack would leave the sender's blocks
DELIVERED_KEPT = 1024  # ids of large payloads received, to recognise resent copies
BLOB_ID_BYTES = 16  # a large payload's id: random, made by its sender
SEALED_INLINE = b"\x00"  # + the payload: what GridTransport seals, for an inline payload
SEALED_BLOCKS = b"\x01"  # + msgpack {"b": [[cid, size], ...], "t": total, "k": key, "i": id}
ACK_PREFIX = "gridgraph.ack."  # + endpoint identity
MAX_ANNOUNCEMENT = 4096  # bytes of a discovery message (a heartbeat has ~150)
MAX_ACK = 256  # bytes of a message on an ack topic (a sealed ack has ~90)
DISCOVERY_RATE, DISCOVERY_BURST = 16.0, 64  # per sending node (which may run many workers)
MESSAGE_RATE, MESSAGE_BURST = 1000.0, 4000  # other messages a second per node and topic
assert BLOCK_SIZE + secure.TAG_BYTES <= MAX_BLOCK_SIZE


class MalformedEnvelope(ValueError):
    """A PubSub message that is not a gridgraph envelope, or whose blocks do not add up."""


def largest_payload(max_total: int) -> int:
    """The largest payload a receiver that drops messages over `max_total` bytes takes:
    sealed, a block payload grows by a tag per block (what `WorkerTransport` counts)."""
    return max(0, max_total - secure.TAG_BYTES * -(-max_total // BLOCK_SIZE))


def pack_inline(payload: bytes) -> bytes:
    return msgpack.packb({"v": ENVELOPE_VERSION, "n": os.urandom(16), "d": payload})


def pack_blocks(blocks: list[tuple[str, int]], total: int) -> bytes:
    refs = [[cid, size] for cid, size in blocks]
    return msgpack.packb({"v": ENVELOPE_VERSION, "n": os.urandom(16), "b": refs, "t": total})


def sealed_inline(payload: bytes | bytearray) -> bytes:
    """What `GridTransport` seals for a payload carried in the message itself."""
    return SEALED_INLINE + payload


def sealed_blocks(blocks: list[tuple[str, int]], total: int, key: bytes, blob: bytes) -> bytes:
    """What `GridTransport` seals for a payload stored as blocks, under `key`; `blob`
    tells the receiver's copies of the payload apart (`GridTransport._wanted`)."""
    refs = [[cid, size] for cid, size in blocks]
    return SEALED_BLOCKS + msgpack.packb({"b": refs, "t": total, "k": key, "i": blob})


def unpack(message: bytes) -> dict:
    """Decode and validate an envelope; raise MalformedEnvelope if it is not one."""
    try:  # (a map, and a list per block: each block's reference has 40 bytes or more)
        envelope = wire.unpackb(message, max_containers=2 + len(message) // 40, raw=False)
    except wire.WireError as error:
        raise MalformedEnvelope(f"not an envelope: {error}") from error
    if not isinstance(envelope, dict) or envelope.get("v") != ENVELOPE_VERSION:
        raise MalformedEnvelope(f"not a version {ENVELOPE_VERSION} envelope")
    return check_envelope(envelope)


def check_envelope(envelope: dict) -> dict:
    """Check an envelope's inline data or block list; raise MalformedEnvelope if it is bad."""
    if isinstance(envelope.get("d"), bytes):
        return envelope
    blocks, total = envelope.get("b"), envelope.get("t")
    if not isinstance(blocks, list) or not blocks or not isinstance(total, int):
        raise MalformedEnvelope("envelope has neither inline data nor a block list")
    for ref in blocks:
        ok = isinstance(ref, list) and len(ref) == 2 and isinstance(ref[0], str)
        if not ok or not isinstance(ref[1], int) or not 0 < ref[1] <= MAX_BLOCK_SIZE:
            raise MalformedEnvelope(f"bad block reference {ref!r:.80}")
    if sum(size for _, size in blocks) != total:
        raise MalformedEnvelope(f"block sizes do not add up to the declared total {total}")
    return envelope


class IpfsTransport(Transport):
    """An endpoint on a Kubo PubSub network; `identity` is the node's libp2p peer id.

    Every PubSub message is a msgpack map (the envelope) with a fresh random nonce, so that
    two publishes of the same payload never look alike: {"v": 1, "n": nonce, "d": payload}
    for payloads up to INLINE_MAX bytes, else {"v": 1, "n": nonce, "b": [[cid, size], ...],
    "t": total}: the payload cut into BLOCK_SIZE pieces, each stored with `block put`, which
    the receiver fetches with `block get` (bitswap pulls them from the publisher), checking
    every size and the total, before it hands the joined payload to the handlers.

    Example:
        transport = IpfsTransport("/ip4/127.0.0.1/tcp/5001")
        transport.subscribe("results", lambda sender, payload: inbox.put((sender, payload)))
        transport.wait_for_peers("jobs", 2)
        transport.publish("jobs", b"...")
        transport.close()
    """

    def __init__(
        self,
        api: str,
        *,
        deliver_own: bool = False,
        fetch_timeout: float = 30.0,
        kubo: Kubo | None = None,
        budget: MemoryBudget | None = None,
    ) -> None:
        super().__init__()
        self.kubo = kubo or Kubo(api)
        self.peer = self.kubo.id()
        self.identity = self.peer
        self.deliver_own = deliver_own
        self.fetch_timeout = fetch_timeout
        self.progress = False  # bars for large payloads (progress.py)
        self._lock = threading.Lock()
        self._handlers: dict[str, list[Handler]] = {}
        self._streams: dict[str, Subscription] = {}
        self._threads: list[threading.Thread] = []
        self._closed = threading.Event()
        self._pending: dict[str, int] = {}  # sending peer -> block payloads in flight
        # what the payloads being fetched will hold, per sending peer (a worker's, shared
        # with its runtime: one budget for its network process)
        self.budget = budget or MemoryBudget(None)
        self._drops = DropLog(log)
        self._rates = {  # (discovery?) -> messages per sending node (and topic)
            True: RateLimiter(DISCOVERY_RATE, DISCOVERY_BURST),
            False: RateLimiter(MESSAGE_RATE, MESSAGE_BURST),
        }
        self._assembler = ThreadPoolExecutor(ASSEMBLERS, thread_name_prefix="ipfs-assemble")
        self._fetcher = ThreadPoolExecutor(
            ASSEMBLERS * FETCH_WINDOW, thread_name_prefix="ipfs-fetch"
        )  # (never a queue: each assembler submits at most FETCH_WINDOW at a time)
        # (blocks to send are stored on threads of their own)
        self._putter = ThreadPoolExecutor(PUT_PARALLELISM, thread_name_prefix="ipfs-put")

    # --- sending ---------------------------------------------------------------------------

    def publish(
        self, topic: str, payload: bytes, counted: bool = True, to: str | None = None
    ) -> None:
        """Publish in plaintext: every subscriber reads it, whatever `to` says."""
        if self._closed.is_set():
            raise RuntimeError(f"transport {self.identity} is closed")
        payload = bytes(payload)
        if len(payload) <= INLINE_MAX:
            message, blocked = pack_inline(payload), 0
        else:
            pieces = [payload[i : i + BLOCK_SIZE] for i in range(0, len(payload), BLOCK_SIZE)]
            blocks = self._put_blocks(pieces, f"send {topic}")
            message, blocked = pack_blocks(blocks, len(payload)), len(payload)
        self._publish(topic, message)
        if counted:
            self.sent.add(len(message) + blocked)

    def _publish(self, topic: str, message: bytes) -> None:
        self.kubo.pubsub_pub(self.wire_topic(topic), message)

    def _put_blocks(self, pieces: list, label: str) -> list[tuple[str, int]]:
        """Store pieces as blocks, several at once; [(cid, size)] in order."""
        bar = Progress(label, sum(len(p) for p in pieces), self.progress)

        def put(piece: bytes) -> tuple[str, int]:
            cid = self.kubo.block_put(bytes(piece))
            bar.add(len(piece))
            return cid, len(piece)

        try:
            return list(self._putter.map(put, pieces))
        finally:
            bar.close()

    def wire_topic(self, topic: str) -> str:
        """The PubSub topic that carries `topic` (the same here)."""
        return topic

    # --- receiving -------------------------------------------------------------------------

    def subscribe(self, topic: str, handler: Handler) -> None:
        """Add a handler; the node is subscribed to `topic` when this returns."""
        if self._closed.is_set():
            raise RuntimeError(f"transport {self.identity} is closed")
        with self._lock:
            if topic in self._handlers:
                self._handlers[topic].append(handler)
                return
            self._handlers[topic] = [handler]
            self._streams[topic] = self._sub(topic)
        thread = threading.Thread(
            target=self._read, args=(topic,), name=f"ipfs-sub-{topic}", daemon=True
        )
        self._threads.append(thread)
        thread.start()

    def _sub(self, topic: str) -> Subscription:
        return self.kubo.pubsub_sub(self.wire_topic(topic), max_data=self.max_message(topic))

    def max_message(self, topic: str) -> int:
        """The largest PubSub message read on `topic` (bytes): larger ones are dropped
        unparsed. Announcements and acks are small; others are under go-libp2p-pubsub's cap."""
        if topic == DISCOVERY_TOPIC:
            return MAX_ANNOUNCEMENT
        if topic.startswith(ACK_PREFIX):
            return MAX_ACK
        return MAX_BLOCK_SIZE

    def wait_for_peers(self, topic: str, n: int, timeout: float = 10.0) -> list[str]:
        """Wait until at least `n` connected peers subscribe to `topic`; return their ids
        (a subscription takes a moment to reach the other peers)."""
        deadline = time.monotonic() + timeout
        while True:
            peers = self.kubo.pubsub_peers(self.wire_topic(topic))
            if len(peers) >= n:
                return peers
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{len(peers)} of {n} peers subscribed to {topic!r} after {timeout}s; "
                    "are the other nodes up, connected and subscribed?"
                )
            time.sleep(0.02)

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            streams = list(self._streams.values())
        for stream in streams:
            stream.close()
        for thread in self._threads:
            thread.join(timeout=5.0)
        for pool in (self._assembler, self._fetcher, self._putter):
            pool.shutdown(wait=False, cancel_futures=True)

    def _read(self, topic: str) -> None:
        backoff = 0.1
        while not self._closed.is_set():
            with self._lock:
                stream = self._streams[topic]
            try:
                for message in stream:
                    backoff = 0.1
                    if message.sender != self.peer or self.deliver_own:
                        self._receive(topic, message.sender, message.data)
            except Exception as error:
                if self._closed.is_set():
                    return  # close() pulled the stream (or the fetcher) from under us
                if isinstance(error, KuboError):
                    log.warning("pubsub stream for %r broke (%s); reopening", topic, error)
                else:  # e.g. a line Kubo sent that is not JSON: keep the thread alive
                    log.exception("reading the pubsub stream for %r failed; reopening", topic)
            if self._closed.is_set():
                return
            time.sleep(backoff)
            backoff = min(2 * backoff, 5.0)
            try:
                reopened = self._sub(topic)
            except KuboError as error:
                log.warning("cannot reopen pubsub stream for %r: %s", topic, error)
                continue
            with self._lock:
                self._streams[topic] = reopened
            if self._closed.is_set():  # close() ran while we reopened
                reopened.close()

    def _receive(self, topic: str, peer: str, message: bytes) -> None:
        """On the reader thread: open the message; hand inline data over (handlers only
        enqueue), and leave a block payload to an assembler if `_admit` lets its sending
        peer have one more; else drop it (its sender resends). No payload waits behind
        another peer's blocks. Nothing is opened that `_refusal` refuses."""
        refusal = self._refusal(topic, peer, len(message))
        if refusal is not None:
            if refusal:  # ("": dropped as a matter of course, not worth a line)
                self._drops.warning(peer, "dropped a message on %r from %s: %s", topic, peer,
                                    refusal)  # fmt: skip
            return
        try:
            opened = self._open(topic, peer, message)
        except (MalformedEnvelope, secure.Rejected) as error:
            self._drops.warning(peer, "dropped message on %r from %s: %s", topic, peer, error)
            return
        if opened is None:
            return
        sender, envelope = opened
        if "d" in envelope:
            self._hand(topic, sender, envelope["d"])
            return
        if not self._admit(topic, peer, envelope["t"]):
            return
        if not self._wanted(sender, envelope):
            self._done(peer, envelope["t"])
            return
        try:
            self._assembler.submit(self._assemble, topic, peer, sender, envelope)
        except RuntimeError:  # closed meanwhile
            self._done(peer, envelope["t"])

    def _admit(self, topic: str, peer: str, size: int) -> bool:
        """Whether node `peer` may have one more block payload of `size` bytes fetched now:
        one of the ASSEMBLERS is free, the peer has fewer than PENDING_PER_PEER and than its
        fair share of them among the peers fetching (so that 8 nodes cannot hold all 32 while
        another waits), and its memory budget has room for `size`. Logged if not."""
        with self._lock:
            pending = self._pending.get(peer, 0)
            share = fair_share(ASSEMBLERS, len(self._pending.keys() | {peer}))
            if pending >= min(PENDING_PER_PEER, share) or sum(self._pending.values()) >= ASSEMBLERS:
                self._drops.warning(peer, "dropped a %d-byte message on %r from %s: %d of its "
                                    "payloads are being fetched already", size, topic, peer,
                                    pending)  # fmt: skip
                return False
            if not self.budget.charge(peer, size):
                refusal = self.budget.refusal(peer, size, "its payload")
                self._drops.warning(peer, "dropped a %d-byte message on %r from %s: %s", size,
                                    topic, peer, refusal)  # fmt: skip
                return False
            self._pending[peer] = pending + 1
            return True

    def _assemble(self, topic: str, peer: str, sender: str, envelope: dict) -> None:
        """On an assembler thread: fetch a payload's blocks (on fetch threads of its own),
        then hand it over whole; at the first block not fetched within `fetch_timeout` s,
        drop it (logged)."""
        payload = None
        try:
            bar = Progress(f"receive {topic}", envelope["t"], self.progress)
            try:
                pieces = self._fetch_all(envelope["b"], bar)
            finally:
                bar.close()
            payload = self._join(envelope, pieces)
        except (MalformedEnvelope, secure.Rejected, KuboError) as error:
            self._drops.warning(peer, "dropped message on %r from %s: %s", topic, peer, error)
            return
        except Exception:
            if not self._closed.is_set():  # else: the fetcher was shut down under us
                log.exception("fetching a message on %r from %s failed", topic, peer)
            return
        finally:
            self._release(envelope, peer, delivered=payload is not None)
            self._done(peer, envelope["t"])
        self._hand(topic, sender, payload)
        self._received(sender, envelope)

    def _done(self, peer: str, size: int) -> None:
        """A block payload of node `peer`, of `size` bytes, is no longer fetched (handed over
        to the handlers, whose own budget counts it from then on, or dropped)."""
        self.budget.release(peer, size)
        with self._lock:
            self._pending[peer] -= 1
            if not self._pending[peer]:
                del self._pending[peer]

    def _fetch_all(self, refs: list, bar: Progress) -> list[bytes]:
        """A payload's blocks, in order, at most FETCH_WINDOW being fetched at a time (the
        next starts as the oldest arrives); stops at the first that cannot be fetched."""
        pieces: list[bytes] = []
        waiting: deque[Future] = deque()
        try:
            for ref in refs:
                if len(waiting) == FETCH_WINDOW:
                    pieces.append(waiting.popleft().result())
                waiting.append(self._fetcher.submit(self._fetch, ref, bar))
            while waiting:
                pieces.append(waiting.popleft().result())
        finally:  # after a failure: the rest are not wanted, and none may land after it
            for fetch in waiting:
                fetch.cancel()
            wait(waiting)
        return pieces

    def _fetch(self, ref: list, bar: Progress) -> bytes:
        cid, size = ref
        piece = self.kubo.block_get(cid, timeout=self.fetch_timeout)
        if len(piece) != size:
            raise MalformedEnvelope(f"block {cid} has {len(piece)} bytes, envelope says {size}")
        bar.add(size)
        return piece

    def _hand(self, topic: str, sender: str, payload: bytes) -> None:
        with self._lock:
            handlers = list(self._handlers.get(topic, ()))
        for handler in handlers:
            try:
                handler(sender, payload)
            except Exception:
                log.exception("handler for %r failed on a message from %s", topic, sender)

    # --- what the secure layer overrides ---------------------------------------------------

    def _refusal(self, topic: str, peer: str, size: int) -> str | None:
        """Why a message of `size` bytes from node `peer` on `topic` is dropped unopened (its
        size, its node's rate; "" for a drop not worth a log line), or None."""
        if size > self.max_message(topic):
            return f"{size} bytes, over the {self.max_message(topic)} this topic takes"
        discovery = topic == DISCOVERY_TOPIC
        if not self._rates[discovery].allow(peer if discovery else f"{peer} {topic}"):
            rate = DISCOVERY_RATE if discovery else MESSAGE_RATE
            return f"over its rate of {rate:g} messages a second on this topic"
        return None

    def _open(self, topic: str, peer: str, message: bytes) -> tuple[str, dict] | None:
        """(sender, checked envelope) of a message, or None to skip it silently."""
        return peer, unpack(message)

    def _wanted(self, sender: str, envelope: dict) -> bool:
        """Whether to fetch the blocks of this envelope (False: it is a copy of one we have)."""
        return True

    def _join(self, envelope: dict, pieces: list[bytes]) -> bytes | bytearray:
        return b"".join(pieces)

    def _received(self, sender: str, envelope: dict) -> None:
        """A block payload was handed over."""

    def _release(self, envelope: dict, peer: str, delivered: bool) -> None:
        """Done with a block payload's blocks from node `peer`, delivered or not."""


@dataclass
class _Stored:
    """The blocks of one large payload sent to one receiver, until it acknowledges them."""

    id: bytes
    key: bytes
    blocks: list[tuple[str, int]]
    total: int


class GridTransport(IpfsTransport):
    """The transport gridgraph runs on: every message sealed end to end for the one
    endpoint that subscribes to its topic (secure.py: X25519 keys bound to the libp2p peer
    IDs Kubo signs, AES-GCM, replays dropped).

    `identity` is "<peer ID>~<this endpoint's public key>" (secure.Channel). A message is
    sealed for the identity its publisher gives (`to`), else for the one its topic names
    (`recipient`): `gridgraph.worker.NAME` for the endpoint that owns NAME in `directory`
    (discovery.Directory: its key came in its signed heartbeat; a client's directory honours
    its `trust` and pins; set it before publishing to a worker topic without `to`),
    `gridgraph.client.IDENTITY.SESSION` and `gridgraph.ack.IDENTITY` for the endpoint named in
    the topic. Workers send transfers `to` the identity the client named in the run, and need
    no directory for that. The discovery topic stays readable by all (heartbeats), each
    message carrying its sender's public key. Topics on the wire are hashes of these names
    (`secure.blind_topic`). Sealed inside: a byte saying what follows, then the payload
    (`sealed_inline`) or its block list (`sealed_blocks`): no envelope map and no nonce,
    which the counter makes unneeded. Blocks hold ciphertext only, under a key made for that
    payload, which travels inside the sealed message naming them. The receiver removes its
    fetched copies (`block rm`) once it has them and acknowledges on the sender's ack topic
    (`_received`); the sender then removes its own (`_on_ack`). Unacknowledged blocks go when
    they fall out of the STORED_KEPT payloads kept for resending, and at `close()`. A large
    payload sent again to the same receiver before it acknowledged the first copy reuses the
    blocks. `allow`: peer IDs whose messages are served (the discovery topic excepted, unless
    `closed_discovery`: a client that trusts only some workers hears only them); others are
    dropped, with a log line, before anything is opened. A message opened from an endpoint
    tells `directory` it is alive (`heard`): a worker's replies keep it alive to its client
    whatever floods the discovery topic.
    """

    def __init__(
        self,
        api: str,
        *,
        allow: Iterable[str] | None = None,
        closed_discovery: bool = False,
        progress: bool = False,
        resolve_wait: float = 2.0,
        **kwargs,
    ) -> None:
        super().__init__(api, **kwargs)
        self.channel = secure.Channel(self.peer)
        self.identity = self.channel.identity
        self.directory: WorkerNames | None = None
        self.allow = None if allow is None else frozenset(allow) | {self.peer}
        self.closed_discovery = closed_discovery and allow is not None
        self.progress = progress
        self.resolve_wait = resolve_wait  # how long to wait to hear of a worker named in a topic
        self._stored: OrderedDict[tuple[bytes, str], _Stored] = OrderedDict()
        self._stored_lock = threading.Lock()
        self._fetching: set[tuple[str, bytes]] = set()  # (sender, payload id) being fetched
        self._delivered: OrderedDict[tuple[str, bytes], None] = OrderedDict()  # and done
        self.subscribe(ACK_PREFIX + self.identity, self._on_ack)

    def recipient(self, topic: str) -> str | None:
        """The endpoint that receives what is published on `topic`, or None if none is known."""
        worker = worker_of_topic(topic)
        if worker is not None:
            if self.directory is None:
                return None
            return self.directory.identity(worker, wait=self.resolve_wait)
        client = client_of_topic(topic)
        if client is not None:
            return client
        if topic.startswith(ACK_PREFIX):
            return topic[len(ACK_PREFIX) :]
        return None

    def wire_topic(self, topic: str) -> str:
        return topic if topic == DISCOVERY_TOPIC else secure.blind_topic(topic)

    def owner(self, identity: str) -> str:
        """The Kubo node whose signature the messages of `identity` carry (its libp2p peer
        ID): what per-peer limits count, since one node makes endpoint keys at will."""
        return secure.peer_of(identity)

    def publish(
        self, topic: str, payload: bytes, counted: bool = True, to: str | None = None
    ) -> None:
        """Seal `payload` for `to`, else for `recipient(topic)`, and publish it."""
        if self._closed.is_set():
            raise RuntimeError(f"transport {self.identity} is closed")
        blocked = 0
        if topic == DISCOVERY_TOPIC:
            message = self.channel.announcement(bytes(payload))
        else:
            receiver = to if to is not None else self.recipient(topic)
            if receiver is None:
                raise KuboError(f"no known receiver for topic {topic!r}: nothing sent")
            if len(payload) <= INLINE_MAX:
                body = sealed_inline(payload)
            else:
                stored = self._store(payload, receiver, topic)
                blocked = len(payload)
                body = sealed_blocks(stored.blocks, stored.total, stored.key, stored.id)
            message = self.channel.seal(receiver, topic, body)
        self._publish(topic, message)
        if counted:
            self.sent.add(len(message) + blocked)

    def _store(self, payload: bytes, receiver: str, topic: str) -> _Stored:
        """The encrypted blocks of `payload` for `receiver`: stored now, or still stored."""
        digest = hashlib.blake2b(payload, digest_size=16).digest()
        with self._stored_lock:
            stored = self._stored.get((digest, receiver))
            if stored is not None:
                self._stored.move_to_end((digest, receiver))
                return stored
        key = secure.new_blob_key()
        pieces = secure.seal_pieces(key, payload, BLOCK_SIZE)
        blocks = self._put_blocks(pieces, f"send to {topic}")
        stored = _Stored(os.urandom(BLOB_ID_BYTES), key, blocks, sum(size for _, size in blocks))
        evicted = []
        with self._stored_lock:
            self._stored[(digest, receiver)] = stored
            while len(self._stored) > STORED_KEPT:
                evicted.append(self._stored.popitem(last=False)[1])
        self._remove([cid for old in evicted for cid, _ in old.blocks])
        return stored

    def _refusal(self, topic: str, peer: str, size: int) -> str | None:
        """(and a peer not in `allow`: on a closed discovery topic, silently, since other
        peers' workers announce themselves there all the time)"""
        if self.allow is not None and peer not in self.allow:
            if topic != DISCOVERY_TOPIC:
                return f"peer {peer} is not among the peers this endpoint serves"
            if self.closed_discovery:
                return ""
        return super()._refusal(topic, peer, size)

    def _open(self, topic: str, peer: str, message: bytes) -> tuple[str, dict] | None:
        if topic == DISCOVERY_TOPIC:
            sender, body = secure.open_announcement(peer, message)
            return sender, {"d": body}
        sender, body = self.channel.open(peer, topic, message)
        if self.directory is not None:
            self.directory.heard(sender)
        kind = body[:1]
        if kind == SEALED_INLINE:
            return sender, {"d": body[1:]}
        if kind != SEALED_BLOCKS:
            raise MalformedEnvelope(f"sealed body of unknown kind {kind!r}")
        if topic.startswith(ACK_PREFIX):
            # (an ack is a few bytes: blocks named there only cost us fetches, which any
            # peer that saw our identity could make us wait on)
            raise MalformedEnvelope("an ack names blocks")
        try:
            envelope = wire.unpackb(body[1:], max_containers=2 + len(body) // 40)
        except wire.WireError as error:
            raise MalformedEnvelope(f"sealed block list: {error}") from error
        if not isinstance(envelope, dict) or "d" in envelope:
            raise MalformedEnvelope("sealed block list is not a map of blocks")
        check_envelope(envelope)
        key, blob = envelope.get("k"), envelope.get("i")
        if not isinstance(key, bytes) or len(key) != secure.KEY_BYTES:
            raise MalformedEnvelope("block list without its key")
        if not isinstance(blob, bytes) or len(blob) != BLOB_ID_BYTES:
            # (each is kept, DELIVERED_KEPT of them: ids of 1 MiB would hold 1 GiB)
            raise MalformedEnvelope(f"block list without a {BLOB_ID_BYTES}-byte id")
        return sender, envelope

    def _join(self, envelope: dict, pieces: list[bytes]) -> bytearray:
        return secure.open_pieces(envelope["k"], pieces)

    def _release(self, envelope: dict, peer: str, delivered: bool) -> None:
        """Remove our copies of a payload's blocks, whether it opened or not: else a peer
        naming blocks of its own under a wrong key would fill this node's repo. Only this
        node's copies go, and only blocks not pinned (`block rm` refuses those): what the
        node's garbage collector may drop any time. Block CIDs travel sealed, so a peer can
        name only blocks sent to it, or of its own. One exception: the blocks of a payload
        not delivered from an endpoint on this same node are its sender's own copies, which
        it sends again on a resend; they stay until it removes them."""
        if delivered or peer != self.peer:
            self._remove([cid for cid, _ in envelope["b"]])

    def _wanted(self, sender: str, envelope: dict) -> bool:
        """A resent envelope naming a payload we are fetching is dropped: the first copy
        will be delivered. One naming a payload we already delivered is dropped too, and
        acknowledged again: its sender may have removed the blocks (then they cannot be
        fetched), or not have heard our ack (then it stores the payload anew next time it
        sends it, and that copy is delivered: a request resent because its reply was lost
        still reaches the worker, which answers it from its reply cache)."""
        key = (sender, envelope["i"])
        with self._stored_lock:
            if key in self._delivered:
                again = True
            elif key in self._fetching:
                return False
            else:
                self._fetching.add(key)
                return True
        if again:
            self._acknowledge(sender, envelope)
        return False

    def _assemble(self, topic: str, peer: str, sender: str, envelope: dict) -> None:
        try:
            super()._assemble(topic, peer, sender, envelope)
        finally:
            with self._stored_lock:
                self._fetching.discard((sender, envelope["i"]))

    def _received(self, sender: str, envelope: dict) -> None:
        with self._stored_lock:
            self._delivered[(sender, envelope["i"])] = None
            while len(self._delivered) > DELIVERED_KEPT:
                self._delivered.popitem(last=False)
        self._acknowledge(sender, envelope)

    def _acknowledge(self, sender: str, envelope: dict) -> None:
        """Tell the sender we have its blocks, so that it removes them too."""
        ack = msgpack.packb({"i": envelope["i"]})
        try:
            for _ in range(ACK_COPIES):
                self.publish(ACK_PREFIX + sender, ack, counted=False)
        except (KuboError, RuntimeError) as error:  # closed, or the node is down
            log.debug("ack to %s not sent: %s", sender, error)

    def _on_ack(self, sender: str, payload: bytes) -> None:
        try:
            blob = wire.unpackb(payload, max_containers=1, max_map_len=1).get("i")
        except (wire.WireError, AttributeError):
            self._drops.warning(sender, "dropped a malformed ack from %s", sender)
            return
        with self._stored_lock:
            acked = [k for k, s in self._stored.items() if s.id == blob and k[1] == sender]
            stored = [self._stored.pop(k) for k in acked]
        if stored:
            cids = [cid for s in stored for cid, _ in s.blocks]
            try:
                self._assembler.submit(self._remove, cids)
            except RuntimeError:  # closing: close() removes them
                pass

    def _remove(self, cids: list[str]) -> None:
        """`block rm` of these blocks, tried REMOVE_TRIES times (a busy node may time out)."""
        for attempt in range(REMOVE_TRIES):
            try:
                self.kubo.block_rm(cids)
                return
            except KuboError as error:
                if attempt + 1 == REMOVE_TRIES or self._closed.wait(0.5 * 2**attempt):
                    log.warning("could not remove %d blocks: %s", len(cids), error)
                    return

    def close(self) -> None:
        """Stop, and remove from this node every block we stored that is still kept."""
        if self._closed.is_set():
            return
        with self._stored_lock:
            cids = [cid for s in self._stored.values() for cid, _ in s.blocks]
            self._stored.clear()
        super().close()
        self._remove(cids)


def open_transport(cls: type[IpfsTransport], ipfs: str, **kwargs) -> IpfsTransport:
    try:
        return cls(ipfs, **kwargs)
    except KuboError as e:
        raise KuboError(f"cannot reach the Kubo node at {ipfs} ({e}); is `ipfs daemon` running "
                        "there? (`gridgraph ipfs up` starts a local swarm)") from e  # fmt: skip


class WorkerTransport(GridTransport):
    """GridTransport for a worker: refuses oversized messages before fetching their blocks
    (its workers announce `largest_payload(max_payload)`, so that clients split or refuse
    larger sends before sending), and logs each message it receives (DEBUG)."""

    def __init__(self, api: str, *, max_payload: int = MAX_PAYLOAD, **kwargs) -> None:
        self.max_payload = max_payload  # before super(): it starts receiving
        super().__init__(api, **kwargs)

    def _open(self, topic: str, peer: str, message: bytes) -> tuple[str, dict] | None:
        opened = super()._open(topic, peer, message)
        if opened is not None:
            envelope = opened[1]
            size = envelope["t"] if "b" in envelope else len(envelope["d"])
            if size > self.max_payload:
                raise MalformedEnvelope(f"{size} bytes is over this worker's {self.max_payload}")
        return opened

    def subscribe(self, topic: str, handler: Handler) -> None:
        def logged(sender: str, payload: bytes) -> None:
            log.debug("%d bytes on %s from %s", len(payload), topic, sender)
            handler(sender, payload)

        super().subscribe(topic, logged if topic != DISCOVERY_TOPIC else handler)
