"""The worker's outbox: publications decided where nothing may block, sent by one thread.

State: a queue of (peer, topic, payload, identity it is for or None), the bytes waiting per
peer, and the thread that publishes them in order.

Policy: the transport's thread (refusals, replies and transfers sent again, asks for a
resend) never waits on a publish, which a slow node, or on a local bus a subscriber, can
hold up; what waits here is charged to the peer it is for in the worker's memory budget
(its payload and WAITING_BYTES), and released once published. A publication stops at its
peer's share, but for two: a refusal may take it REFUSAL_ROOM past it (a peer whose share is
full is told so, by a refusal naming it), and a payload kept elsewhere and sent again (a
reply, a transfer: charged where it is kept, and here again, since it outlives its keeping
while it waits) may take it its own cost past it (its keeping never keeps it from going).
Past that, or past the budget's cap, a publication is shed: not queued, a line logged
(DropLog), `put` says so. Each caller sheds only what may go unsent: a refusal (the request
was not run; a resend is judged afresh, or gets the reply its record keeps), a reply or a
transfer sent again (its client, or worker, asks again later).
"""

from __future__ import annotations

import logging
import queue
import threading

from gridgraph.exec.safety.budget import MemoryBudget
from gridgraph.exec.safety.droplog import DropLog
from gridgraph.exec.safety.limits import format_size
from gridgraph.exec.transport import Transport

log = logging.getLogger("gridgraph.worker")

WAITING_BYTES = 200  # charged per publication waiting, beside its payload (tuple, queue slot)
REFUSAL_ROOM = 64 << 10  # bytes past its share a peer's refusals may take (~100 of them)


class Outbox:
    """Publications waiting for the worker's sender thread, each charged to its peer."""

    def __init__(
        self, name: str, transport: Transport, budget: MemoryBudget, drops: DropLog
    ) -> None:
        self.name, self.transport, self.budget, self._drops = name, transport, budget, drops
        self._queue: queue.Queue = queue.Queue()
        self._waiting: dict[str, int] = {}  # peer -> bytes charged for it here (under _lock)
        self._lock = threading.Lock()
        self.thread = threading.Thread(target=self._send_loop, name=f"{name}-out", daemon=True)
        self.thread.start()

    def put(
        self, peer: str, topic: str, payload: bytes, to: str | None = None, *,
        refusal: bool = False, kept: bool = False,
    ) -> bool:  # fmt: skip
        """Queue `payload` for `topic` (only for identity `to`, when given), charged to
        `peer` until published; False, and nothing queued, past the peer's share (and
        REFUSAL_ROOM past it for a `refusal`; its own cost, for a payload `kept` and
        charged elsewhere) or the budget's cap."""
        cost = len(payload) + WAITING_BYTES
        beyond = REFUSAL_ROOM if refusal else cost if kept else 0
        if not self.budget.charge(peer, cost, beyond=beyond):
            with self._lock:
                waiting = self._waiting.get(peer, 0)
            self._drops.warning(
                peer, "%s: dropped a message of %s to %s: the messages waiting to be sent "
                "for its peer hold %s, and the peer holds %s of its share of %s",
                self.name, format_size(len(payload)), topic[:80], format_size(waiting),
                format_size(self.budget.held(peer)), format_size(self.budget.share or 0),
            )  # fmt: skip
            return False
        with self._lock:
            self._waiting[peer] = self._waiting.get(peer, 0) + cost
        self._queue.put((peer, topic, payload, to))
        return True

    def waiting(self, peer: str) -> int:
        """Bytes charged to `peer` for what waits here now."""
        with self._lock:
            return self._waiting.get(peer, 0)

    def close(self) -> None:
        """Stop the sender thread once what waits ahead of this is sent."""
        self._queue.put(None)

    def _send_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            peer, topic, payload, to = item
            try:
                self.transport.publish(topic, payload, False, to)  # ipfs: a recovery
            except Exception as e:
                log.warning("%s: could not send to %s: %s", self.name, topic, e)
            finally:
                cost = len(payload) + WAITING_BYTES
                with self._lock:
                    left = self._waiting.get(peer, 0) - cost
                    if left > 0:
                        self._waiting[peer] = left
                    else:
                        self._waiting.pop(peer, None)
                self.budget.release(peer, cost)
