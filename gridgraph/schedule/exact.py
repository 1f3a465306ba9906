"""The optimum placement of a small graph, by brute force (for tests and benchmarks).

Every assignment of the free alias units to the workers is simulated under the same cost
model as `place`, so `place`'s result can be measured as a ratio to the best possible one.
Feasible up to about ten free units on three workers (3**10 = 59,049 simulations).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping

from gridgraph.schedule.cost import CostModel, Timeline
from gridgraph.schedule.place import PlacementError, alias_units
from gridgraph.trace.graph import Node, Value


def free_units(nodes: list[Node], values: Mapping[int, Value]) -> int:
    """How many alias units of the graph are neither stored nor pinned (the search's depth)."""
    return sum(w is None for w in alias_units(nodes, values).fixed)


def exact_placement(
    nodes: list[Node],
    values: Mapping[int, Value],
    workers: list[str],
    cost: CostModel | None = None,
    objective: str = "time",
    max_units: int = 12,
) -> tuple[dict[int, str], float]:
    """(placement, its objective) minimizing `objective` ("time": estimated finish time,
    then bytes; "bytes": bytes moved, then time) over all placements that keep alias units.

    >>> placement, best = exact_placement(nodes, values, ["w0", "w1", "w2"], CostModel.local())
    >>> finish_time(nodes, values, place(nodes, values, ["w0", "w1", "w2"])) / best
    1.0
    """
    if objective not in ("time", "bytes"):
        raise ValueError(f"objective must be 'time' or 'bytes', not {objective!r}")
    units = alias_units(nodes, values)
    free = [u for u, w in enumerate(units.fixed) if w is None]
    if len(free) > max_units:
        raise PlacementError(
            f"{len(free)} free units: too many to search exhaustively (max_units={max_units})"
        )
    tl = Timeline(nodes, values, workers, cost)
    uw = [-1 if w is None else tl.index[w] for w in units.fixed]
    choices = [tl.index[w] for w in workers]
    best: tuple[tuple[float, float], list[int]] | None = None
    for combo in itertools.product(choices, repeat=len(free)):
        for u, w in zip(free, combo):
            uw[u] = w
        wn = [uw[u] for u in units.of]
        t, b = tl.run(wn), tl.bytes_moved(wn)
        key = (t, b) if objective == "time" else (b, t)
        if best is None or key < best[0]:
            best = (key, wn)
    return tl.decode(best[1]), best[0][0]
