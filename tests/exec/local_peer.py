"""A hand-made client on a local grid's bus, and a second user's grid on the same workers."""

from __future__ import annotations

import gridgraph as gg
from gridgraph.exec.client.client import Client
from gridgraph.exec.grid import Grid
from gridgraph.schedule.program import Slot
from tests.exec import hostile


def Peer(grid: gg.Grid, name: str = "mallory", session: str = "s") -> hostile.Peer:
    """A hand-made client with an endpoint `name` of its own on a local grid's bus."""
    return hostile.Peer(grid.client.transport._bus.endpoint(name), session)


def second_client(grid: gg.Grid, name: str = "bob") -> Grid:
    """Another user's grid over the same in-process workers (a second session, own peer)."""
    bus = grid.client.transport._bus
    return Grid(Client(bus.endpoint(name), [w.name for w in grid.workers]))


def add_one_in_place(vid: int) -> dict:
    """A run that adds 1 to value `vid` in place: run twice, it would add 2."""
    step = ["call", "aten::add_.Tensor", [Slot(0), 1.0], {}, [1], [], False]
    return {"kind": "run", "run": 1, "plan": 1, "program": [[step]], "slots": [vid, vid + 1],
            "params": []}  # fmt: skip
