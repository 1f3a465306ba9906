"""The optimum placement of a graph, for tests and benchmarks.

`exact_placement`: by brute force. Every assignment of the free alias units to the workers
is simulated under the same cost model as `place`, so `place`'s result can be measured as a
ratio to the best possible one. Feasible up to about ten free units on three workers
(3**10 = 59,049 simulations).

`fewest_bytes`: the fewest bytes any placement moves, as an integer linear program over the
same alias units (a unit stays on one worker; stored and pinned units are fixed), solved by
scipy's `milp` (HiGHS): exact for graphs of a few hundred nodes. scipy is not a dependency of
gridgraph: `pip install -e .[bench]`.

`fastest_within`: the fastest placement among those moving at most a given number of bytes,
by branch and bound. Both a partial simulation's latest finish time and the bytes its copies
move only grow as more nodes are simulated, so a branch is cut as soon as either passes its
bound: exact for training steps of a few dozen free units, where a ceiling of 1.5x the
fewest bytes leaves few branches. It tells whether "fast" and "few bytes" conflict on a graph:
if the fastest placement within the ceiling is slower than `place`'s, no placement is both.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping

from gridgraph.schedule.cost import CostModel, SimState, Timeline
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
    max_bytes: float = math.inf,
) -> tuple[dict[int, str], float] | None:
    """(placement, its objective) minimizing `objective` ("time": estimated finish time,
    then bytes; "bytes": bytes moved, then time) over all placements that keep alias units
    and move at most `max_bytes` (None if none does).

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
        if b <= max_bytes and (best is None or key < best[0]):
            best = (key, wn)
    return None if best is None else (tl.decode(best[1]), best[0][0])


def fewest_bytes(
    nodes: list[Node], values: Mapping[int, Value], workers: list[str]
) -> tuple[dict[int, str], int]:
    """(placement, bytes it moves): the fewest bytes moved between workers by any placement
    that keeps alias units together, found exactly by an integer linear program (needs scipy).

    Variables: x[u, w] = 1 if free unit u runs on worker w; y[v, w] >= 0 for each value v
    and worker w, the bytes of v are paid once if y[v, w] = 1. For every node of unit r
    reading v made by unit p (or stored on a worker): y[v, w] >= x[r, w] - x[p, w], which with
    minimization makes y[v, w] = 1 exactly when a reader of v is on w and v is not: what
    `Timeline.bytes_moved` counts. Minimize the sum of bytes(v) * y[v, w].

    >>> placement, least = fewest_bytes(nodes, values, ["w0", "w1", "w2"])
    >>> bytes_moved(nodes, values, place(nodes, values, ["w0", "w1", "w2"])) / least
    1.0
    """
    import numpy as np
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_array

    units = alias_units(nodes, values)
    tl = Timeline(nodes, values, workers)
    W = len(tl.workers)
    allowed = [tl.index[w] for w in workers]
    fixed = [None if w is None else tl.index[w] for w in units.fixed]
    x: dict[tuple[int, int], int] = {}  # (free unit, worker) -> variable
    for u, f in enumerate(fixed):
        if f is None:
            for w in allowed:
                x[(u, w)] = len(x)
    y: dict[tuple[int, int], int] = {}  # (value key, worker) -> variable
    nbytes: dict[int, int] = {}
    rows, cols, vals, lower = [], [], [], []

    def on(u: int, w: int, row: int, sign: int) -> float:
        """Add sign * [unit u on w] to a constraint row; the constant part, if u is fixed."""
        if fixed[u] is not None:
            return sign * float(fixed[u] == w)
        if (u, w) in x:
            rows.append(row)
            cols.append(x[(u, w)])
            vals.append(sign)
        return 0.0

    n_x = len(x)
    for i, row_in in enumerate(tl.ins):
        r = units.of[i]
        for p, s, key, nb in row_in:
            pu = units.of[p] if p >= 0 else None
            if pu == r:
                continue
            nbytes[key] = nb
            for w in range(W):
                if (key, w) not in y:
                    y[(key, w)] = n_x + len(y)
                row = len(lower)
                rows.append(row)
                cols.append(y[(key, w)])
                vals.append(1)
                # y - x[r, w] + x[p, w] >= 0, constants moved to the bound
                const = on(r, w, row, -1)
                const += on(pu, w, row, 1) if pu is not None else float(s == w)
                lower.append(-const)
    n_rows = len(lower)
    for u, f in enumerate(fixed):  # every free unit on exactly one worker
        if f is None:
            for w in allowed:
                rows.append(n_rows)
                cols.append(x[(u, w)])
                vals.append(1)
            n_rows += 1
    n = n_x + len(y)
    if n == 0:  # every unit fixed, and nothing read from elsewhere
        wn = [fixed[u] for u in units.of]
        return tl.decode(wn), tl.bytes_moved(wn)
    c = np.zeros(n)
    for (key, _), j in y.items():
        c[j] = nbytes[key]
    lb = np.array(lower + [1.0] * (n_rows - len(lower)))
    ub = np.array([np.inf] * len(lower) + [1.0] * (n_rows - len(lower)))
    a = coo_array((vals, (rows, cols)), shape=(n_rows, n)).tocsr()
    integrality = np.array([1] * n_x + [0] * len(y))
    result = milp(
        c,
        constraints=LinearConstraint(a, lb, ub),
        integrality=integrality,
        bounds=Bounds(np.zeros(n), np.ones(n)),
    )
    if not result.success:
        raise PlacementError(f"the fewest-bytes program was not solved: {result.message}")
    uw = [f if f is not None else -1 for f in fixed]
    for (u, w), j in x.items():
        if result.x[j] > 0.5:
            uw[u] = w
    wn = [uw[u] for u in units.of]
    return tl.decode(wn), tl.bytes_moved(wn)


def fastest_within(
    nodes: list[Node],
    values: Mapping[int, Value],
    workers: list[str],
    cost: CostModel | None,
    max_bytes: float,
    known: Mapping[int, str] | None = None,
    max_branches: int = 2_000_000,
) -> tuple[dict[int, str], float] | None:
    """(placement, its estimated finish time): the fastest placement that keeps alias units
    and moves at most `max_bytes`, found exactly by branch and bound; None if none does.

    The free units are decided in recording order (at their first node), each on every
    worker in turn; the simulation runs on node by node, and a branch is cut where its
    latest finish time plus the compute that must still follow it reaches the best found so
    far, or its copies pass `max_bytes`.
    `known`: a placement to start from (within `max_bytes`, e.g. `fewest_bytes`'s), whose
    time is the first bound. More than `max_branches` decisions raise PlacementError.

    >>> fewest, least = fewest_bytes(nodes, values, workers)
    >>> _, t = fastest_within(nodes, values, workers, cost, 1.5 * least, known=fewest)
    >>> t / finish_time(nodes, values, place(nodes, values, workers, cost), cost)
    1.42
    """
    units = alias_units(nodes, values)
    tl = Timeline(nodes, values, workers, cost)
    choices = [tl.index[w] for w in workers]
    size = {}  # copy key (value key * W + worker) -> bytes
    for row in tl.ins:
        for _, _, key, nbytes in row:
            for w in range(tl.W):
                size[key + w] = nbytes
    # Compute that must still run after each node, at the fastest worker: on workers sharing
    # one machine, every later op (each runs after the last); else the longest chain of ops
    # that read its result, one after another.
    rest = [0.0] * len(nodes)
    for j in range(len(nodes) - 1, -1, -1):
        for p, _, _, _ in tl.ins[j]:
            if p >= 0:
                rest[p] = max(rest[p], min(tl.ct[j]) + rest[j])
        if tl.shared and j > 0:
            rest[j - 1] = max(rest[j - 1], min(tl.ct[j]) + rest[j])
    best: list = [math.inf, None]  # finish time, worker per node
    if known is not None:
        wn = tl.encode(known)
        if tl.bytes_moved(wn) <= max_bytes:
            best = [tl.run(wn), wn]
    branches = 0

    def search(i: int, uw: list[int], wn: list[int], st: SimState, moved: int) -> None:
        """Simulate from node i on; uw / wn: the worker of each unit / node decided so far."""
        nonlocal branches
        while i < len(nodes):
            u = units.of[i]
            if uw[u] >= 0:
                moved = _advance(tl, i, wn, st, moved, size)
                if st.fin[i] + rest[i] >= best[0] or moved > max_bytes:
                    return
                i += 1
                continue
            for w in choices:
                branches += 1
                if branches > max_branches:
                    raise PlacementError(
                        f"more than {max_branches} branches: too many placements within "
                        f"{max_bytes:.0f} bytes to search (max_branches={max_branches})"
                    )
                uw_w, wn_w = list(uw), list(wn)
                uw_w[u] = w
                for j in units.members[u]:
                    wn_w[j] = w
                st_w = st.resumed(st.workers(), dict(st.copies), dict(st.msgs))
                moved_w = _advance(tl, i, wn_w, st_w, moved, size)
                if st_w.fin[i] + rest[i] < best[0] and moved_w <= max_bytes:
                    search(i + 1, uw_w, wn_w, st_w, moved_w)
            return
        best[:] = [max(st.free, default=0.0), list(wn)]

    uw = [-1 if w is None else tl.index[w] for w in units.fixed]
    search(0, uw, [uw[u] for u in units.of], tl.start(), 0)
    if best[1] is None:
        return None
    return tl.decode(best[1]), best[0]


def _advance(tl: Timeline, i: int, wn: list[int], st: SimState, moved: int, size: dict) -> int:
    """Simulate node i; returns the bytes moved so far, counting the copies it made."""
    made = len(st.copies)
    tl.advance(i, wn, st)
    for key in itertools.islice(reversed(st.copies), len(st.copies) - made):
        moved += size[key]  # copies are only ever added: the new ones are the last
    return moved
