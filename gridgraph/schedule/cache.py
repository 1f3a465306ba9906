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
    """(cache key, slot order) for running `nodes`; slots number values as first met.

    The key is one flat tuple of ints and small tuples: per node its interned signature,
    then the slots it reads; per external input its location and aliasing. This runs on
    every step, so it avoids building a tuple per node.
    """
    slot_of: dict[int, int] = {}
    slots: list[int] = []
    storage_slot: dict[int, int] = {}  # storage of an external input -> its first slot
    key: list[Hashable] = []
    for node in nodes:
        ins = node.inputs()
        for v in ins:
            if v not in slot_of:
                s = slot_of[v] = len(slots)
                slots.append(v)
                value = values[v]
                key.append((value.location, storage_slot.setdefault(value.storage, s)))
        key.append(node.sig)
        key.extend([slot_of[v] for v in ins])
        if dynamic and node.id in dynamic:
            key.append("dynamic")
        n = len(slots)
        for v in node.outputs:
            slot_of[v] = n
            n += 1
        slots.extend(node.outputs)
    for v in fetch:
        if v not in slot_of:
            slot_of[v] = len(slots)
            slots.append(v)
            key.append(("fetch", values[v].location))
    kept = sorted(slot_of[v] for v in keep if v in slot_of)
    key.append(("kept", *kept))
    key.append(("fetched", *[slot_of[v] for v in fetch]))
    return tuple(key), slots


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

    def drop_naming(self, worker: str) -> None:
        """Forget the plans that give `worker` a part (it was lost, or is another process)."""
        for key in [k for k, plan in self._plans.items() if worker in plan.programs]:
            del self._plans[key]

    def put(self, key: Hashable, plan: Plan) -> Plan:
        self._plans[key] = plan
        while len(self._plans) > self.capacity:
            self._plans.popitem(last=False)
        return plan
