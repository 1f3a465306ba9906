"""Replies waiting to be sent stay within their peer's share of the worker's memory.

What the transport's thread decides to publish (refusals, replies sent again, transfers
resent) waits in the worker's outbox for its one sender thread. On main that queue had a
rate per peer but no bound in bytes, and nothing in it was charged to the memory budget: a
peer whose replies could not be published (a slow node; here, on the local bus, its own
subscription, which the sender thread calls) made it grow at its refusal rate for as long
as that lasted, past its share of the network process's memory.
"""

from __future__ import annotations

import threading
import time

import torch

import gridgraph as gg
from gridgraph.exec.safety.limits import Limits
from gridgraph.exec.worker.outbox import REFUSAL_ROOM
from tests.exec.local_peer import Peer

SHARE = 256 << 10  # a peer's share: max_worker_memory / 16 (peer_shares)


def _waiting(worker, topic: str) -> int:  # noqa: ANN001
    """Bytes of the payloads waiting in `worker`'s outbox to go to `topic`."""
    box = getattr(worker._outbox, "_queue", worker._outbox)
    with box.mutex:
        items = [i for i in box.queue if i is not None]
    return sum(len(item[-2]) for item in items if item[-3] == topic)


def test_replies_a_peer_cannot_take_pile_up_only_to_its_share():
    with gg.local_grid(1, limits=Limits(max_worker_memory=16 * SHARE)) as grid:
        worker, mallory = grid.local_workers[0], Peer(grid)
        taking, release = threading.Event(), threading.Event()

        def stuck(sender: str, payload: bytes) -> None:  # mallory takes none of its replies
            taking.set()
            release.wait(60)

        mallory.transport.subscribe(mallory.topic, stuck)
        try:
            for _ in range(4000):  # each refused (~250 B), at most at its refusal rate
                mallory.send("w0", {"kind": "nonsense"})
            assert taking.wait(10)
            waiting, held = _waiting(worker, mallory.topic), worker.budget.held("mallory")
            print(f"waiting for mallory: {waiting} B, held for it: {held} B; share {SHARE} B")
            assert 0 < waiting <= held <= SHARE + REFUSAL_ROOM  # (room to say it is past it)
            assert worker._outbox.waiting("mallory") >= waiting
            a = torch.arange(6.0)  # another client is served meanwhile
            assert torch.equal((a.send(grid.workers[0]) * 2).get(), a * 2)
        finally:
            release.set()
        deadline = time.monotonic() + 20
        while _waiting(worker, mallory.topic) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _waiting(worker, mallory.topic) == 0
        told = []
        while not mallory.replies.empty():
            told.append(mallory.replies.get_nowait()["error"]["message"])
        assert any("past its share of this worker's memory" in text for text in told)
        assert mallory.request("w0", {"kind": "ping"})["ok"]  # served again once it takes them
        mallory.close()
        assert worker.budget.held("mallory") == 0  # what waited was released once published
