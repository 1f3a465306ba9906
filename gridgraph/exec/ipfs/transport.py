"""`Transport` over one Kubo node: PubSub for messages, raw blocks for large payloads.

Wire format: every PubSub message is a msgpack map (the envelope) with a fresh random nonce,
so that two publishes of the same payload never look alike, even to a router that derives
message ids from content (Kubo 0.43.1's default id is sender + seqno; 16 bytes buy certainty):
- inline, for payloads up to `INLINE_MAX` bytes: {"v": 1, "n": nonce, "d": payload}
- by blocks, for larger ones: {"v": 1, "n": nonce, "b": [[cid, size], ...], "t": total}.
  The payload is cut into `BLOCK_SIZE` pieces, each stored with `block put`; the receiver
  fetches them with `block get` (bitswap pulls them from the publisher), checks every size and
  the total, and hands the joined payload to the handler.
Both limits keep far under go-libp2p-pubsub's 1 MiB message cap (larger messages are dropped
silently, with no error for the publisher) and gridgraph's 1 MiB block cap.

Delivery: one reader thread per subscribed topic reads Kubo's `pubsub/sub` stream and calls
the topic's handlers in arrival order, so a handler that blocks stalls its topic. Kubo hands a
node its own publications too; they are skipped unless `deliver_own=True`. A malformed
envelope, a block that cannot be fetched or a failing handler is logged and dropped; a broken
stream is reopened until `close()`.

Subscriptions take a moment to reach the other peers; `wait_for_peers` waits for that.

Example:
    transport = IpfsTransport("/ip4/127.0.0.1/tcp/5001")
    transport.subscribe("results", lambda sender, payload: inbox.put((sender, payload)))
    transport.wait_for_peers("jobs", 2)
    transport.publish("jobs", b"...")
    transport.close()
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

import msgpack

from gridgraph.exec.ipfs.kubo import MAX_BLOCK_SIZE, Kubo, KuboError, Subscription
from gridgraph.exec.transport import Handler, Transport
from gridgraph.exec.worker import DISCOVERY_TOPIC

log = logging.getLogger(__name__)

ENVELOPE_VERSION = 1
INLINE_MAX = 256 * 1024
BLOCK_SIZE = 512 * 1024
FETCH_PARALLELISM = 8
MAX_PAYLOAD = 1 << 30  # a worker fetches no message larger than this (bytes)
PUBLISH_TRIES = 8  # publishes refused by Kubo's own seqno check are retried this often
STORED_KEPT = 16  # large payloads whose blocks a transport remembers, for resending
assert BLOCK_SIZE <= MAX_BLOCK_SIZE


class MalformedEnvelope(ValueError):
    """A PubSub message that is not a gridgraph envelope, or whose blocks do not add up."""


def pack_inline(payload: bytes) -> bytes:
    return msgpack.packb({"v": ENVELOPE_VERSION, "n": os.urandom(16), "d": payload})


def pack_blocks(blocks: list[tuple[str, int]], total: int) -> bytes:
    refs = [[cid, size] for cid, size in blocks]
    return msgpack.packb({"v": ENVELOPE_VERSION, "n": os.urandom(16), "b": refs, "t": total})


def unpack(message: bytes) -> dict:
    """Decode and validate an envelope; raise MalformedEnvelope if it is not one."""
    try:
        envelope = msgpack.unpackb(message, raw=False)
    except Exception as error:  # msgpack raises several unrelated types
        raise MalformedEnvelope(f"not msgpack: {error}") from error
    if not isinstance(envelope, dict) or envelope.get("v") != ENVELOPE_VERSION:
        raise MalformedEnvelope(f"not a version {ENVELOPE_VERSION} envelope")
    if isinstance(envelope.get("d"), bytes):
        return envelope
    blocks, total = envelope.get("b"), envelope.get("t")
    if not isinstance(blocks, list) or not isinstance(total, int):
        raise MalformedEnvelope("envelope has neither inline data nor a block list")
    for ref in blocks:
        ok = isinstance(ref, list) and len(ref) == 2 and isinstance(ref[0], str)
        if not ok or not isinstance(ref[1], int) or not 0 < ref[1] <= MAX_BLOCK_SIZE:
            raise MalformedEnvelope(f"bad block reference {ref!r}")
    if sum(size for _, size in blocks) != total:
        raise MalformedEnvelope(f"block sizes do not add up to the declared total {total}")
    return envelope


class IpfsTransport(Transport):
    """An endpoint on a Kubo PubSub network; `identity` is the node's libp2p peer id."""

    def __init__(
        self,
        api: str,
        *,
        deliver_own: bool = False,
        fetch_timeout: float = 60.0,
        kubo: Kubo | None = None,
    ) -> None:
        super().__init__()
        self.kubo = kubo or Kubo(api)
        self.identity = self.kubo.id()
        self.deliver_own = deliver_own
        self.fetch_timeout = fetch_timeout
        self._lock = threading.Lock()
        self._handlers: dict[str, list[Handler]] = {}
        self._streams: dict[str, Subscription] = {}
        self._threads: list[threading.Thread] = []
        self._closed = threading.Event()
        self._fetcher = ThreadPoolExecutor(FETCH_PARALLELISM, thread_name_prefix="ipfs-fetch")

    def publish(self, topic: str, payload: bytes, counted: bool = True) -> None:
        if self._closed.is_set():
            raise RuntimeError(f"transport {self.identity} is closed")
        payload = bytes(payload)
        if len(payload) <= INLINE_MAX:
            message = pack_inline(payload)
            blocked = 0
        else:
            blocks = []
            for start in range(0, len(payload), BLOCK_SIZE):
                piece = payload[start : start + BLOCK_SIZE]
                blocks.append((self.kubo.block_put(piece), len(piece)))
            message = pack_blocks(blocks, len(payload))
            blocked = len(payload)
        self.kubo.pubsub_pub(topic, message)
        if counted:
            self.sent.add(len(message) + blocked)

    def subscribe(self, topic: str, handler: Handler) -> None:
        """Add a handler; the node is subscribed to `topic` when this returns."""
        if self._closed.is_set():
            raise RuntimeError(f"transport {self.identity} is closed")
        with self._lock:
            if topic in self._handlers:
                self._handlers[topic].append(handler)
                return
            self._handlers[topic] = [handler]
            self._streams[topic] = self.kubo.pubsub_sub(topic)
        thread = threading.Thread(
            target=self._read, args=(topic,), name=f"ipfs-sub-{topic}", daemon=True
        )
        self._threads.append(thread)
        thread.start()

    def wait_for_peers(self, topic: str, n: int, timeout: float = 10.0) -> list[str]:
        """Wait until at least `n` connected peers subscribe to `topic`; return their ids."""
        deadline = time.monotonic() + timeout
        while True:
            peers = self.kubo.pubsub_peers(topic)
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
        self._fetcher.shutdown(wait=False, cancel_futures=True)

    def _read(self, topic: str) -> None:
        backoff = 0.1
        while not self._closed.is_set():
            with self._lock:
                stream = self._streams[topic]
            try:
                for message in stream:
                    backoff = 0.1
                    if message.sender != self.identity or self.deliver_own:
                        self._deliver(topic, message.sender, message.data)
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
                reopened = self.kubo.pubsub_sub(topic)
            except KuboError as error:
                log.warning("cannot reopen pubsub stream for %r: %s", topic, error)
                continue
            with self._lock:
                self._streams[topic] = reopened
            if self._closed.is_set():  # close() ran while we reopened
                reopened.close()

    def _deliver(self, topic: str, sender: str, message: bytes) -> None:
        try:
            payload = self._payload(message)
        except (MalformedEnvelope, KuboError) as error:
            log.warning("dropped message on %r from %s: %s", topic, sender, error)
            return
        with self._lock:
            handlers = list(self._handlers.get(topic, ()))
        for handler in handlers:
            try:
                handler(sender, payload)
            except Exception:
                log.exception("handler for %r failed on a message from %s", topic, sender)

    def _payload(self, message: bytes) -> bytes:
        envelope = unpack(message)
        if "d" in envelope:
            return envelope["d"]
        # Fetching blocks one by one leaves bitswap idle between round trips: 10 MB takes
        # ~0.9 s sequentially, ~0.2 s with 8 in flight (loopback).
        payload = b"".join(self._fetcher.map(self._fetch, envelope["b"]))
        if len(payload) != envelope["t"]:
            declared = envelope["t"]
            raise MalformedEnvelope(f"payload has {len(payload)} bytes, envelope says {declared}")
        return payload

    def _fetch(self, ref: list) -> bytes:
        cid, size = ref
        piece = self.kubo.block_get(cid, timeout=self.fetch_timeout)
        if len(piece) != size:
            raise MalformedEnvelope(f"block {cid} has {len(piece)} bytes, envelope says {size}")
        return piece


class GridTransport(IpfsTransport):
    """IpfsTransport tuned for gridgraph's retries. Upstream candidates, both:

    - Publishes again when Kubo refuses a message with "validation ignored". Kubo validates a
      node's own publications concurrently and ignores one whose seqno is below one it already
      accepted, so two threads or processes publishing through one node at once (a worker's
      heartbeat and its replies, a client sharing a worker's node) make one fail. That message
      never went out: sending it again is safe. (Receiving nodes run the same check, also
      concurrently, and drop a message now and then: the layers above resend.)
    - Stores a large payload's blocks once: a retried request or transfer (the same bytes)
      publishes only a new envelope naming the same blocks.
    """

    def __init__(self, api: str, **kwargs) -> None:
        super().__init__(api, **kwargs)
        self._stored: OrderedDict[bytes, list[tuple[str, int]]] = OrderedDict()  # by digest
        self._stored_lock = threading.Lock()

    def publish(self, topic: str, payload: bytes, counted: bool = True) -> None:
        if self._closed.is_set():
            raise RuntimeError(f"transport {self.identity} is closed")
        if len(payload) <= INLINE_MAX:
            message, blocked = pack_inline(bytes(payload)), 0
        else:
            message, blocked = pack_blocks(self._blocks(payload), len(payload)), len(payload)
        for attempt in range(PUBLISH_TRIES):
            try:
                self.kubo.pubsub_pub(topic, message)
                break
            except KuboError as e:
                if "validation ignored" not in str(e) or attempt == PUBLISH_TRIES - 1:
                    raise
                time.sleep(0.001 * 2**attempt)
        if counted:
            self.sent.add(len(message) + blocked)

    def _blocks(self, payload: bytes) -> list[tuple[str, int]]:
        digest = hashlib.blake2b(payload, digest_size=16).digest()
        with self._stored_lock:
            if digest in self._stored:
                self._stored.move_to_end(digest)
                return self._stored[digest]
        view = memoryview(payload)
        pieces = [view[i : i + BLOCK_SIZE] for i in range(0, len(view), BLOCK_SIZE)]
        blocks = [(self.kubo.block_put(bytes(piece)), len(piece)) for piece in pieces]
        with self._stored_lock:
            self._stored[digest] = blocks
            while len(self._stored) > STORED_KEPT:
                self._stored.popitem(last=False)
        return blocks


def open_transport(cls: type[IpfsTransport], ipfs: str, **kwargs) -> IpfsTransport:
    try:
        return cls(ipfs, **kwargs)
    except KuboError as e:
        raise KuboError(f"cannot reach the Kubo node at {ipfs} ({e}); is `ipfs daemon` running "
                        "there? (`gridgraph ipfs up` starts a local swarm)") from e  # fmt: skip


class WorkerTransport(GridTransport):
    """GridTransport for a worker: refuses oversized messages before fetching their blocks,
    and logs each message it receives (DEBUG)."""

    def __init__(self, api: str, *, max_payload: int = MAX_PAYLOAD, **kwargs) -> None:
        super().__init__(api, **kwargs)
        self.max_payload = max_payload

    def _payload(self, message: bytes) -> bytes:
        envelope = unpack(message)
        size = envelope["t"] if "b" in envelope else len(envelope["d"])
        if size > self.max_payload:
            raise MalformedEnvelope(f"{size} bytes is over this worker's {self.max_payload}")
        return super()._payload(message)

    def subscribe(self, topic: str, handler: Handler) -> None:
        def logged(sender: str, payload: bytes) -> None:
            log.debug("%d bytes on %s from %s", len(payload), topic, sender)
            handler(sender, payload)

        super().subscribe(topic, logged if topic != DISCOVERY_TOPIC else handler)
