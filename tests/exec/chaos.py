"""A local bus that loses, duplicates and reorders messages, as PubSub may under load.

`ChaosBus(seed, lose=..., duplicate=..., delay=...)`: each message published is dropped
with probability `lose`, delivered twice with probability `duplicate`, and each delivery is
held back a random time up to `delay` seconds (so later messages overtake it). `which(kind)`
picks the message kinds it meddles with (by default, all); `chaos` turns it on and off.
Delivery of delayed messages runs on one thread of the bus's own, in due order.
"""

from __future__ import annotations

import heapq
import itertools
import random
import threading
import time
from collections.abc import Callable

from gridgraph.exec import wire
from gridgraph.exec.transport import LocalBus


class ChaosBus(LocalBus):
    """A LocalBus that drops, duplicates and delays (reorders) messages at random."""

    def __init__(
        self,
        seed: int = 0,
        *,
        lose: float = 0.0,
        duplicate: float = 0.0,
        delay: float = 0.0,
        which: Callable[[str], bool] = lambda kind: True,
    ) -> None:
        super().__init__()
        self.rng = random.Random(seed)
        self.lose, self.duplicate, self.delay, self.which = lose, duplicate, delay, which
        self.chaos = True
        self.lost = self.duplicated = self.delayed = 0
        self._due: list[tuple[float, int, tuple]] = []
        self._order = itertools.count()
        self._cv = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._deliver_due, daemon=True)
        self._thread.start()

    def _deliver(self, sender: str, topic: str, payload: bytes, to: str | None) -> None:
        if not self.chaos or not self.which(_kind(payload)):
            super()._deliver(sender, topic, payload, to)
            return
        with self._cv:
            if self.rng.random() < self.lose:
                self.lost += 1
                return
            copies = 2 if self.rng.random() < self.duplicate else 1
            self.duplicated += copies - 1
            waits = [self.rng.random() * self.delay for _ in range(copies)]
        for wait in waits:
            if wait <= 0:
                super()._deliver(sender, topic, payload, to)
                continue
            with self._cv:
                self.delayed += 1
                heapq.heappush(
                    self._due,
                    (time.monotonic() + wait, next(self._order), (sender, topic, payload, to)),
                )
                self._cv.notify()

    def _deliver_due(self) -> None:
        while True:
            with self._cv:
                while not self._closed and (not self._due or self._due[0][0] > time.monotonic()):
                    self._cv.wait(self._due[0][0] - time.monotonic() if self._due else None)
                if self._closed:
                    return
                _, _, message = heapq.heappop(self._due)
            try:
                LocalBus._deliver(self, *message)
            except Exception:  # (a closed endpoint's handler): as a lost message
                pass

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join(5)


def _kind(payload: bytes) -> str:
    try:
        return str(wire.decode(payload).get("kind"))
    except wire.WireError:
        return ""
