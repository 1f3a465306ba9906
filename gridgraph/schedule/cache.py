"""The plan cache: a trace that repeats (a training step) is compiled once.

Two runs share a plan when their nodes have equal signatures (op, input and output metadata,
non-float scalars, pins: `Node.sig`, computed while recording), the same wiring between
nodes, the same locations and aliasing of their external inputs, and the same values kept
and fetched. `signature` computes that key together with the run's canonical slot order in
one pass over the nodes, so a hit costs a few microseconds per node and no compilation.
Floats and local tensors are a run's parameters, not part of the key: an optimizer whose
step size changes every step still hits.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Hashable

from gridgraph.schedule.plan import Plan
from gridgraph.trace.graph import Node, Value


def signature(
    nodes: list[Node],
    values: dict[int, Value],
    keep: set[int],
    fetch: list[int],
    dynamic: set[int],
) -> tuple[Hashable, list[int]]:
    """(cache key, slot order) for running `nodes`; slots number values as first met."""
    slot_of: dict[int, int] = {}
    slots: list[int] = []
    storage_slot: dict[int, int] = {}  # storage of an external input -> its first slot
    parts: list[Hashable] = []
    for node in nodes:
        ins = []
        for v in node.inputs():
            s = slot_of.get(v)
            if s is None:
                s = slot_of[v] = len(slots)
                slots.append(v)
                value = values[v]
                parts.append((s, value.location, storage_slot.setdefault(value.storage, s)))
            ins.append(s)
        for v in node.outputs:
            slot_of[v] = len(slots)
            slots.append(v)
        parts.append((node.sig, tuple(ins), node.id in dynamic))
    for v in fetch:
        if v not in slot_of:
            slot_of[v] = len(slots)
            slots.append(v)
            parts.append(("fetch", values[v].location))
    kept = tuple(s for s, v in enumerate(slots) if v in keep)
    fetched = tuple(slot_of[v] for v in fetch)
    return (tuple(parts), kept, fetched), slots


class PlanCache:
    """Compiled plans by signature, least recently used dropped first."""

    def __init__(self, capacity: int = 64) -> None:
        self.capacity = capacity
        self._plans: OrderedDict[Hashable, Plan] = OrderedDict()
        self._ids = itertools.count(1)
        self.hits = self.misses = 0

    def get(self, key: Hashable) -> Plan | None:
        plan = self._plans.get(key)
        if plan is None:
            self.misses += 1
        else:
            self.hits += 1
            self._plans.move_to_end(key)
        return plan

    def new_id(self) -> int:
        return next(self._ids)

    def put(self, key: Hashable, plan: Plan) -> Plan:
        self._plans[key] = plan
        while len(self._plans) > self.capacity:
            self._plans.popitem(last=False)
        return plan
