"""Storage moves: a stored tensor copied straight from its worker to another, keeping its
value ids, before a run whose op needs it on one worker with a tensor stored elsewhere.

Policy: a storage moves only when one value is all that is known of it and it covers its
storage densely from offset 0: the copy a worker receives is contiguous, and two views of
one storage would arrive as two separate tensors (refused with PlacementError, saying to
move it first). Each pair of workers exchanges one message; the plan runs once, uncached.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable
from typing import Any, Protocol

from gridgraph.errors import PlacementError
from gridgraph.schedule.cache import PlanCache
from gridgraph.schedule.plan import Plan
from gridgraph.schedule.program import Free, Recv, Send, Step
from gridgraph.trace.graph import Graph
from gridgraph.trace.meta import TensorMeta


class Runs(Protocol):
    """What of a client (exec/client/client.py) a storage move uses."""

    graph: Graph
    plans: PlanCache

    def run_plan(
        self, plan: Plan, slots: list[int], params: list[Any], learn_as: Hashable | None = None
    ) -> dict[str, dict]: ...


def move_storages(client: Runs, moves: dict[int, str]) -> None:
    """Move stored tensors (storage -> worker) straight from worker to worker, keeping
    their value ids, so that pending nodes naming them need no change."""
    values = client.graph.values
    by_storage: dict[int, list[int]] = {s: [] for s in moves}
    for vid, value in values.items():
        if value.storage in by_storage and value.location is not None:
            by_storage[value.storage].append(vid)
    group: dict[tuple[str, str], list[int]] = defaultdict(list)  # (src, dst) -> slots
    slots: list[int] = []
    for storage, dst in moves.items():
        vid, *others = by_storage[storage]
        src, meta = values[vid].location, values[vid].meta
        if others or meta.offset or not _dense(meta):
            raise PlacementError(
                f"an op views or writes tensors stored on {src!r} and {dst!r}, which must "
                f"then be one tensor on one worker, and %{vid} {tuple(meta.shape)} on {src!r}"
                " shares its storage with other tensors; move it first (pointer.move(w))"
            )
        slots.append(vid)
        group[(src, dst)].append(len(slots) - 1)
    steps: dict[str, list[Step]] = defaultdict(list)
    for (src, dst), moved in group.items():  # one message from each worker to each other
        steps[src].extend([Send(moved, dst), *(Free(slot) for slot in moved)])
        steps[dst].append(Recv(moved, src))
    plan = Plan({w: [s] for w, s in steps.items()}, slots, [], {})
    plan.id = client.plans.new_id()  # run once, never cached
    client.run_plan(plan, slots, [], learn_as="storage move")
    for storage, dst in moves.items():
        values[by_storage[storage][0]].location = dst


def _dense(meta: TensorMeta) -> bool:
    """Whether a tensor of this layout is contiguous (what a transfer delivers)."""
    expected = 1
    for size, stride in reversed(list(zip(meta.shape, meta.stride))):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True
