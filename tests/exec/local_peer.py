"""A hand-made client on a local grid's bus, and a second user's grid on the same workers."""

from __future__ import annotations

import queue
import time
import uuid

import gridgraph as gg
from gridgraph.exec import wire
from gridgraph.exec.client import Client
from gridgraph.exec.grid import Grid
from gridgraph.exec.worker import worker_topic
from gridgraph.schedule.plan import Slot


class Peer:
    """A hand-made client on a grid's bus: any session, any request, any request id."""

    def __init__(self, grid: gg.Grid, name: str = "mallory", session: str = "s") -> None:
        self.transport = grid.client.transport._bus.endpoint(name)
        self.session = session
        self.topic = f"replies.{name}.{uuid.uuid4().hex[:6]}"
        self.replies: queue.Queue = queue.Queue()
        self.transport.subscribe(self.topic, lambda sender, p: self.replies.put(wire.decode(p)))

    def send(self, worker: str, msg: dict, rid: str | None = None) -> str:
        rid = rid or uuid.uuid4().hex
        full = {"id": rid, "reply_to": self.topic, "session": self.session, **msg}
        self.transport.publish(worker_topic(worker), wire.encode(full))
        return rid

    def reply(self, rid: str, timeout: float = 10.0) -> dict:
        """The reply to `rid` (replies to other requests are dropped)."""
        deadline = time.monotonic() + timeout
        while True:
            msg = self.replies.get(timeout=max(0.0, deadline - time.monotonic()))
            if msg.get("re") == rid:
                return msg

    def request(self, worker: str, msg: dict, rid: str | None = None) -> dict:
        return self.reply(self.send(worker, msg, rid))

    def no_reply_within(self, seconds: float) -> bool:
        try:
            self.replies.get(timeout=seconds)
        except queue.Empty:
            return True
        return False


def second_client(grid: gg.Grid, name: str = "bob") -> Grid:
    """Another user's grid over the same in-process workers (a second session, own peer)."""
    bus = grid.client.transport._bus
    return Grid(Client(bus.endpoint(name), [w.name for w in grid.workers]))


def add_one_in_place(vid: int) -> dict:
    """A run that adds 1 to value `vid` in place: run twice, it would add 2."""
    step = ["call", "aten::add_.Tensor", [Slot(0), 1.0], {}, [1], [], False]
    return {"kind": "run", "run": 1, "plan": 1, "program": [[step]], "slots": [vid, vid + 1],
            "params": []}  # fmt: skip
