"""Runs a client sent and has not settled yet: what asynchronous dispatch keeps.

State (under the client's run lock):
    runs       runs sent whose replies were not yet taken, oldest first (`Run`)
    per worker how many of them each worker has (`max_in_flight` at most: the client
               settles the oldest before it sends one more)
    held       value id -> how many runs in flight name it: a pointer that dies meanwhile is
               released once they settled (a free could overtake them on the transport)
    failure    the first error a run settled without a sync point raised, kept for the next

Policy: `.compute()`, `gg.compute(...)` and a compiled step's replay send their run and
return; a sync point (a value read, a data-dependent op, a request other than `put`,
`grid.sync()`, `close`) settles every run in flight, oldest first, and raises the first
failure among them, naming the op, the worker and the user's line. A run that failed marks
the values it defines as failed (using one raises that error), and frees what it would have.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from gridgraph.schedule.plan import Plan
from gridgraph.trace.graph import Node

MAX_IN_FLIGHT = 8  # runs in flight per worker, by default


@dataclass(slots=True)
class Run:
    """A run sent: what waiting for it, and a failure of it, need."""

    number: int
    plan: Plan
    slots: list[int]
    rids: dict[str, str]  # worker -> request id
    msgs: dict[str, dict]  # worker -> the request (sent again with its program if dropped)
    learn_as: Hashable | None
    sent_at: float  # time.monotonic() when it was sent
    where: dict[int, str] | None = None  # the user's file:line by slot, where known
    nodes: list[Node] = field(default_factory=list)  # its nodes, for the lines of errors
    outputs: list[int] = field(default_factory=list)  # values it defines that outlive it
    frees_on_error: list[tuple[str, int]] = field(default_factory=list)  # (worker, id)
    prefetch: bool = False  # its replies bring small results back (gg.compile)

    def where_of(self) -> dict[int, str]:
        """The user's file:line by slot, from its nodes and `where`."""
        slot_of = {vid: i for i, vid in enumerate(self.slots)}
        found = {}
        for node in self.nodes:
            for vid in node.outputs:
                if vid in slot_of and "where" in node.meta:
                    found[slot_of[vid]] = node.meta["where"]
        return {**found, **(self.where or {})}


class InFlight:
    """The runs of one client in flight; see the module docstring."""

    def __init__(self, max_in_flight: int = MAX_IN_FLIGHT) -> None:
        self.max_in_flight = max_in_flight
        self.runs: deque[Run] = deque()
        self.per_worker: Counter[str] = Counter()
        self.held: Counter[int] = Counter()
        self.failure: BaseException | None = None
        self.latest = 0  # the number of the latest run sent

    def add(self, run: Run) -> None:
        self.runs.append(run)
        self.per_worker.update(run.rids.keys())
        self.held.update(run.slots)
        self.latest = run.number

    def full(self, workers: Any) -> bool:
        """Whether one more run to `workers` would pass the bound on any of them."""
        return any(self.per_worker[w] >= self.max_in_flight for w in workers)

    def pop(self) -> Run:
        """The oldest run, no longer in flight."""
        run = self.runs.popleft()
        self.per_worker.subtract(run.rids.keys())
        self.held.subtract(run.slots)
        for vid in run.slots:
            if self.held[vid] <= 0:
                del self.held[vid]
        return run
