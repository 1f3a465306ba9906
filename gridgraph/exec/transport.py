"""The transport boundary: publish bytes to a topic, subscribe a handler to a topic.

Everything above this file (client, worker) talks only to `Transport`. There are two
implementations: `LocalBus` here (in-process workers, the embedded default) and the Kubo
PubSub transport in `ipfs/transport.py`. Delivery is best effort and unordered across topics;
the layers above add message ids, acknowledgements and retries.

A handler is called as `handler(sender, payload)`, where `sender` is the publishing
endpoint's identity (a local name in-process, the libp2p peer ID and key on IPFS, where the
signature and the sealing make it trustworthy). Handlers must return quickly: they only
enqueue.

Addressing: a message is for one endpoint, the one whose identity the publisher gives as `to`,
else the one `recipient(topic)` names (on IPFS only the endpoint a message is sealed for can
open it; the LocalBus, given no `to`, hands it to every subscriber of the topic). Workers
publish transfers `to` the identity the client named for the receiving worker, so that no view
of the worker's own (its discovery directory on IPFS) decides who reads the client's data.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

from gridgraph.errors import GridError
from gridgraph.exec.protocol import worker_of_topic

Handler = Callable[[str, bytes], None]


class NotSent(Exception):
    """A publish that did not go out this time, though the transport is up (Kubo refused it
    as "validation ignored" however often it was tried): for the layers above, a message
    lost, which whoever waits for its answer sends again."""


@dataclass
class TrafficCounter:
    """Messages and bytes this endpoint has published since the last reset."""

    messages: int = 0
    bytes: int = 0

    def add(self, nbytes: int) -> None:
        self.messages += 1
        self.bytes += nbytes

    def reset(self) -> None:
        self.messages = 0
        self.bytes = 0


class Transport(ABC):
    """One endpoint on a publish/subscribe network."""

    #: this endpoint's identity, as receivers see it in `sender`
    identity: str

    def __init__(self) -> None:
        self.sent = TrafficCounter()

    @abstractmethod
    def publish(
        self, topic: str, payload: bytes, counted: bool = True, to: str | None = None
    ) -> None:
        """Send `payload` on `topic` (best effort): to the endpoint whose identity is `to`
        only, when given; else to the topic's subscribers (on IPFS sealed for
        `recipient(topic)`, the only one that can read it).

        `counted=False` keeps the message out of `sent` (used for the stats exchange itself).
        """

    @abstractmethod
    def subscribe(self, topic: str, handler: Handler) -> None:
        """Call `handler(sender, payload)` for each message published to `topic`."""

    @abstractmethod
    def close(self) -> None:
        """Stop delivering and release what the endpoint holds."""

    def recipient(self, topic: str) -> str | None:
        """The identity of the endpoint that receives what is published on `topic`, as it
        appears as `sender` in its own messages; None if unknown. A client accepts a reply
        only from the recipient of its request. Raises GridError where several endpoints
        claim a worker's topic and none is known to be the worker (a LocalBus): a client
        never picks one."""
        return None

    def owner(self, identity: str) -> str:
        """Who answers for the messages of `identity`: the unit a worker keeps its per-peer
        limits for. Where endpoints cost nothing to make (on IPFS, a key), that is what
        made them (the Kubo node), else one peer could multiply its limits at will."""
        return identity


class LocalBus:
    """An in-process publish/subscribe network: topics map to handlers, delivery is a call."""

    def __init__(self) -> None:
        self._handlers: dict[str, list[tuple[str, Handler]]] = {}  # topic -> (identity, handler)
        self._lock = threading.Lock()

    def endpoint(self, identity: str) -> LocalTransport:
        return LocalTransport(self, identity)

    def _subscribe(self, topic: str, handler: Handler, identity: str) -> None:
        with self._lock:
            self._handlers.setdefault(topic, []).append((identity, handler))

    def _recipient(self, topic: str) -> str | None:
        with self._lock:
            subscribers = sorted({identity for identity, _ in self._handlers.get(topic, ())})
        name = worker_of_topic(topic)
        if len(subscribers) > 1 and name is not None:
            raise GridError(
                f"worker name {name!r} is claimed by {len(subscribers)} endpoints of this bus "
                f"({', '.join(repr(s) for s in subscribers)}); a client will not pick one: "
                f"close the others"
            )
        return subscribers[0] if len(subscribers) == 1 else None

    def _unsubscribe_all(self, identity: str, handlers: list[tuple[str, Handler]]) -> None:
        with self._lock:
            for topic, handler in handlers:
                if (identity, handler) in self._handlers.get(topic, []):
                    self._handlers[topic].remove((identity, handler))

    def _deliver(self, sender: str, topic: str, payload: bytes, to: str | None) -> None:
        with self._lock:
            handlers = [h for who, h in self._handlers.get(topic, ()) if to in (None, who)]
        for handler in handlers:
            handler(sender, payload)


class LocalTransport(Transport):
    """An endpoint on a `LocalBus`."""

    def __init__(self, bus: LocalBus, identity: str) -> None:
        super().__init__()
        self.identity = identity
        self._bus = bus
        self._mine: list[tuple[str, Handler]] = []
        self._closed = False

    def publish(
        self, topic: str, payload: bytes, counted: bool = True, to: str | None = None
    ) -> None:
        """Deliver to the handlers of `topic` (of endpoint `to` only, when given)."""
        if self._closed:
            raise RuntimeError(f"transport {self.identity!r} is closed")
        if counted:
            self.sent.add(len(payload))
        self._bus._deliver(self.identity, topic, payload, to)

    def subscribe(self, topic: str, handler: Handler) -> None:
        self._mine.append((topic, handler))
        self._bus._subscribe(topic, handler, self.identity)

    def recipient(self, topic: str) -> str | None:
        return self._bus._recipient(topic)

    def close(self) -> None:
        self._closed = True
        self._bus._unsubscribe_all(self.identity, self._mine)
        self._mine.clear()
