"""Placement: which worker runs each node.

`naive_placement` is the baseline every smarter placement is measured against: an op runs
where its largest input lives. Aliasing is never broken: an op that writes a tensor, or makes
a view of it, runs where that tensor's storage lives, so mutation through views keeps its
meaning.

`place` minimizes the estimated finish time of the graph under a `CostModel` (see cost.py):
alias units fixed where their storage lives, list scheduling from several starting points,
then local moves within a fixed budget of simulated steps (its docstring says how).

An optional memory cap bounds, per worker, the bytes of the storages whose home it is.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Mapping
from dataclasses import dataclass

from networkx.utils import UnionFind

from gridgraph.errors import PlacementError
from gridgraph.schedule.cost import CostModel, Timeline
from gridgraph.trace.graph import Node, Value


def storage_anchor(node: Node, values: dict[int, Value], where: dict[int, str]) -> str | None:
    """The worker a node must run on because it writes or views a storage, else None."""
    for _, vid in node.writes:
        return where[vid]
    stores = {values[v].storage: v for v in node.inputs()}
    for out in node.outputs:
        value = values.get(out)
        if value is not None and value.storage in stores:
            return where[stores[value.storage]]
    return None


def naive_placement(nodes: list[Node], values: dict[int, Value]) -> dict[int, str]:
    """Each node on the worker holding its largest input (by bytes); first input wins ties."""
    where: dict[int, str] = {}  # value id -> worker, as placed so far

    def loc(vid: int) -> str:
        if vid not in where:
            where[vid] = values[vid].location
        return where[vid]

    placement: dict[int, str] = {}
    for node in nodes:
        inputs = node.inputs()
        for v in inputs:
            loc(v)
        w = storage_anchor(node, values, where) or node.meta.get("pin")
        if w is None:
            w = loc(max(inputs, key=lambda v: values[v].meta.nbytes))
        placement[node.id] = w
        for v in node.outputs:
            where[v] = w
    return placement


# --- alias units ----------------------------------------------------------------------------


@dataclass
class Units:
    """Nodes (by index in recording order) grouped into units that must share a worker."""

    of: list[int]  # unit of each node
    members: list[list[int]]  # node indices of each unit, in recording order
    fixed: list[str | None]  # worker a unit must run on (stored data or a pin), else None
    nbytes: list[int]  # bytes of the new storages each unit creates
    stored: dict[str, int]  # bytes already stored on each worker that the graph touches
    # Units that view or write storages stored on more than one worker: unit -> the worker
    # and bytes of each such storage. They cannot run until all but one worker's move.
    split_homes: dict[int, dict[int, tuple[str, int]]]


def _where(node: Node) -> str:
    return f"{node.name} (recorded at {node.meta.get('where', '<unknown>')})"


def alias_units(nodes: list[Node], values: Mapping[int, Value]) -> Units:
    """Contract every storage with the nodes that create, view or write it.

    A storage read by a node is not joined: the reader may get a copy. A storage that is
    already stored somewhere fixes its unit there; else the first `gg.on` pin in the unit
    does (the same rule as `naive_placement`, which lets a view follow its base).
    """
    # Union-find over provisional units (the index of a unit's first node): a node joins
    # the unit of a storage it views or writes; only a node touching two units merges them.
    uf = UnionFind()
    unit_of: dict[int, int] = {}  # storage -> provisional unit
    located: dict[int, str] = {}  # storage -> worker holding it now
    size: dict[int, int] = {}  # storage -> bytes (its largest value)
    provisional: list[int] = []
    for i, node in enumerate(nodes):
        for vid in node.inputs():
            v = values[vid]
            if v.location is not None and v.storage not in located:
                located[v.storage] = v.location
                size[v.storage] = v.meta.nbytes
        u = -1
        for vid in (*node.outputs, *(vid for _, vid in node.writes)):
            v = values.get(vid)
            if v is None:
                continue
            s = v.storage
            size[s] = max(size.get(s, 0), v.meta.nbytes)  # a storage may hold zero bytes
            other = unit_of.get(s)
            if other is None:
                u = i if u < 0 else u
                unit_of[s] = u
            elif u < 0:
                u = other
            elif other != u:
                uf.union(u, other)
        provisional.append(i if u < 0 else u)
    merged = uf.parents

    def root(u: int) -> int:
        return uf[u] if u in merged else u

    root_index: dict[int, int] = {}
    of: list[int] = []
    members: list[list[int]] = []
    fixed: list[str | None] = []
    for i, node in enumerate(nodes):
        u = root_index.setdefault(root(provisional[i]), len(members))
        if u == len(members):  # units are numbered in the order of their first node
            members.append([])
            fixed.append(None)
        of.append(u)
        members[u].append(i)
        if "pin" in node.meta and fixed[u] is None:
            fixed[u] = node.meta["pin"]
    nbytes = [0] * len(members)
    stored: dict[str, int] = {}
    homes: list[dict[int, tuple[str, int]]] = [{} for _ in members]  # stored storages
    for s, w in located.items():
        stored[w] = stored.get(w, 0) + size[s]
    for s in sorted(unit_of):  # storages only read in this graph belong to no unit
        u = root_index[root(unit_of[s])]
        if s in located:
            homes[u][s] = (located[s], size[s])
        else:
            nbytes[u] += size[s]
    split_homes = {}
    for u, held in enumerate(homes):
        if held:
            fixed[u] = next(iter(held.values()))[0]  # stored data cannot move: wins over a pin
        if len({w for w, _ in held.values()}) > 1:
            split_homes[u] = held
    return Units(of, members, fixed, nbytes, stored, split_homes)


def storage_moves(nodes: list[Node], values: Mapping[int, Value]) -> dict[int, str]:
    """Stored storages to move before `nodes` can run: storage -> the worker to move it to.

    One op (or a unit of ops aliasing each other) may write or view tensors stored on two
    workers, as batch norm does with its running mean and variance. Such a unit gathers on
    the worker already holding the most of its bytes (the first one met on a tie); the
    smaller ones move there.
    """
    moves: dict[int, str] = {}
    for held in alias_units(nodes, values).split_homes.values():
        per_worker: dict[str, int] = {}
        for w, n in held.values():
            per_worker[w] = per_worker.get(w, 0) + n
        target = max(per_worker, key=per_worker.__getitem__)
        moves.update((s, target) for s, (w, _) in held.items() if w != target)
    return moves


# --- place --------------------------------------------------------------------------------

# Simulated node steps the refinement may spend on a graph: a deterministic time budget
# (a step is about a microsecond). The rest of the compiler costs about 40 steps per node,
# so large graphs get less, and a 10,000-node graph compiles in about half a second.
REFINE_STEPS = 500_000
MIN_REFINE_STEPS = 100_000
GREEDY_ALPHAS = (0.0, 0.25, 1.0)
# (alpha, whether the greedy scores a transfer joining an open message at its bytes only)
GREEDY_WAYS = tuple((alpha, coalesce) for coalesce in (True, False) for alpha in GREEDY_ALPHAS)


def place(
    nodes: list[Node],
    values: Mapping[int, Value],
    workers: list[str],
    cost: CostModel | None = None,
    memory_cap: int | Mapping[str, int] | None = None,
    effort: float = 1.0,
) -> dict[int, str]:
    """Node id -> worker name, minimizing the estimated finish time under `cost`:

    1. Alias units: the nodes that create, view or write one storage are contracted into one
       unit (union-find over storages). A unit holding a tensor already stored on a worker is
       fixed there; else a `gg.on(w)` pin inside it fixes it to w; every other unit is free. A
       unit holding tensors stored on two workers cannot be placed: `storage_moves` says which
       to move first (the client moves them, worker to worker).
    2. List scheduling in recording order (the order workers run their programs in): each free
       unit goes, at its first node, to the worker where that node finishes earliest, counting
       the transfers it waits for, plus the transfers its later nodes will need from data whose
       place is already known (a transfer that joins a message already open, see plan.py, at its
       bytes only). A sequential chain therefore stays with its data, and a branch moves to an
       idle worker only when the time it gains there beats the transfer. Three variants weigh
       the transfers a choice starts more or less (to keep data together), each once as said and
       once charging every transfer a message's latency as well (which keeps apart what
       coalescing would draw together: each finds better placements on some graphs).
    3. Those, the naive placement and "every free unit on one worker" are starting points. Each
       is refined, the best first, by moves that take one unit to another worker, alone or
       followed by a roll-out of the list scheduling for every unit decided after it (which
       moves a whole branch). A move is kept when the finish time drops, or stays and fewer
       bytes move. Units on the critical path are tried first; a fixed budget of simulated node
       steps bounds the search, so the result is deterministic and a 10,000-node graph compiles
       in about 0.5 s.

    `nodes` in recording order; `memory_cap`: bytes per worker (one number for all, or per
    worker name) of the storages whose home is that worker; `effort` scales the refinement
    budget (0: list scheduling only, fastest; 1: about 0.5 s at most). Deterministic.

    >>> placement = place(nodes, graph.values, ["w0", "w1", "w2"], CostModel.pubsub())
    >>> plan = split(nodes, placement, graph.values, keep)
    """
    if not nodes:
        return {}
    workers = list(workers)
    if not workers:
        raise PlacementError("no workers to place the graph on")
    for node in nodes:
        if node.meta.get("pin", workers[0]) not in workers:
            raise PlacementError(
                f"{_where(node)} is pinned to {node.meta['pin']!r}, which is not one of the "
                f"workers {workers}"
            )
    collecting = gc.isenabled()
    # The search makes many small tuples and no cycles: a collection of the user's (large)
    # heap in between would cost more than the search itself.
    gc.disable()
    try:
        return _place(nodes, values, workers, cost, memory_cap, effort)
    finally:
        if collecting:
            gc.enable()


def _place(nodes, values, workers, cost, memory_cap, effort) -> dict[int, str]:
    units = alias_units(nodes, values)
    for u, held in units.split_homes.items():
        where = sorted({w for w, _ in held.values()})
        raise PlacementError(
            f"{_where(nodes[units.members[u][0]])} and the ops aliasing it view or write "
            f"tensors stored on {' and '.join(map(repr, where))}, which must then be one "
            "tensor on one worker; move all but one first (pointer.move(worker))"
        )
    tl = Timeline(nodes, values, workers, cost)
    room = _room(tl, units, memory_cap)
    search = _Search(tl, units, room, [tl.index[w] for w in workers])
    # Starting points: list scheduling that weighs the transfers a choice starts by alpha
    # (more weight keeps data together; which is best depends on the graph), scoring a
    # transfer that joins an open message at its bytes only or, as if every transfer were a
    # message of its own, at its latency too (this keeps apart placements that coalescing
    # would draw together: each finds better ones on some graphs); the naive placement, and
    # everything free on one worker. Each is refined, best first, while the budget lasts:
    # small graphs refine them all, large ones mostly the best.
    starts: dict[tuple[int, ...], tuple[float, int, tuple[float, bool]]] = {}
    no_room: PlacementError | None = None
    for way in GREEDY_WAYS:
        search.alpha, search.coalesce = way
        try:
            uw, t = search.greedy()
        except PlacementError as e:  # under a memory cap; another start may still fit
            no_room = no_room or e
            continue
        starts.setdefault(tuple(uw), (t, tl.bytes_moved(search.expand(uw)), way))
    naive = search.from_nodes(tl.encode(naive_placement(nodes, values)))
    for uw in [naive] + [search.all_on(w) for w in search.free_workers]:
        if uw is not None and search.fits(uw):
            wn = search.expand(uw)
            starts.setdefault(tuple(uw), (tl.run(wn), tl.bytes_moved(wn), GREEDY_WAYS[0]))
    if not starts:
        raise no_room
    steps = effort * max(MIN_REFINE_STEPS, REFINE_STEPS - 40 * len(nodes))
    best: tuple[float, int, list[int]] | None = None
    for uw, (t, b, way) in sorted(starts.items(), key=lambda s: s[1][:2]):
        if best is not None and steps < 2 * len(nodes):
            break
        if steps <= 0:
            best = (t, b, list(uw))
            break
        search.alpha, search.coalesce = way
        uw, t, b, steps = search.refine(list(uw), steps)
        if best is None or (t, b) < best[:2]:
            best = (t, b, uw)
    return tl.decode(search.expand(best[2]))


def _room(tl: Timeline, units: Units, cap: int | Mapping[str, int] | None) -> list[float]:
    """Bytes each worker may still take as the home of new storages."""
    inf = float("inf")
    if cap is None:
        return [inf] * len(tl.workers)
    caps = [cap if isinstance(cap, int | float) else cap.get(w, inf) for w in tl.workers]
    room = [c - units.stored.get(w, 0) for c, w in zip(caps, tl.workers)]
    for u, w in enumerate(units.fixed):
        if w is not None:
            room[tl.index[w]] -= units.nbytes[u]
    for i, w in enumerate(tl.workers):
        if room[i] < 0:
            raise PlacementError(
                f"worker {w!r} must hold {caps[i] - room[i]:.0f} bytes (tensors stored there "
                f"and ops pinned or aliased to them) but its memory cap is {caps[i]:.0f}; "
                "raise the cap or move tensors to other workers first"
            )
    return room


class _Search:
    """Placements as unit -> worker index lists, and the moves between them."""

    def __init__(self, tl: Timeline, units: Units, room: list[float], free: list[int]) -> None:
        self.tl, self.units, self.room = tl, units, room
        self.free_workers = free
        self.fixed = [-1 if w is None else tl.index[w] for w in units.fixed]
        self.first = [m[0] for m in units.members]
        self.later, self.pushed = self._affinity()
        self.alpha = 0.0  # weight of the transfers a choice starts, on top of its finish
        self.coalesce = True  # score a transfer that joins an open message at its bytes only

    def expand(self, uw: list[int]) -> list[int]:
        return [uw[u] for u in self.units.of]

    def load(self, uw: list[int]) -> list[float]:
        """Bytes of new storages per worker, of the free units placed in `uw`."""
        load = [0.0] * len(self.room)
        for u, w in enumerate(uw):
            if self.fixed[u] < 0 and w >= 0:
                load[w] += self.units.nbytes[u]
        return load

    def fits(self, uw: list[int]) -> bool:
        return all(x <= r for x, r in zip(self.load(uw), self.room))

    def from_nodes(self, wn: list[int]) -> list[int] | None:
        """The unit assignment a node placement makes, or None if it splits a unit."""
        uw = [wn[i] for i in self.first]
        ok = all(wn[i] == uw[u] for i, u in enumerate(self.units.of))
        ok &= all(f < 0 or f == w for f, w in zip(self.fixed, uw))
        return uw if ok else None

    def all_on(self, w: int) -> list[int]:
        return [w if f < 0 else f for f in self.fixed]

    def greedy(self, roll: tuple | None = None, bound: float = math.inf) -> tuple[list[int], float]:
        """List scheduling in recording order: each free unit goes, at its first node, where
        that node finishes earliest, counting also the transfers its later nodes will need
        from data whose place is known, and `self.alpha` times the transfers it starts now.

        From scratch, or as a roll-out `roll` = (uw, wn, load, unit, worker) of the kept run
        from the unit's first node k: units first seen before k keep their worker, the unit
        goes to the worker, the free units after it are decided again. Returns the
        assignment and its finish time, or early, with a time over `bound`, once a node
        finishes after `bound`.
        """
        tl, units, fixed, first = self.tl, self.units, self.fixed, self.first
        lat, ibw, ct, ins, of = tl.lat, tl.ibw, tl.ct, tl.ins, units.of
        later, pushed, room, nbytes = self.later, self.pushed, self.room, units.nbytes
        n = len(ins)
        alpha, shared, coalesce = self.alpha, tl.shared, self.coalesce
        if roll is None:
            k, uw, st = 0, list(fixed), tl.start()
            load = [0.0] * len(tl.workers)
            wn = [uw[u] for u in of]  # -1 for the nodes of undecided units
        else:
            uw, wn, load, unit, worker = roll
            k = first[unit]
            uw, wn, load = list(uw), list(wn), list(load)
            for u in range(unit, len(uw)):  # units are numbered by their first node
                if fixed[u] < 0:
                    load[uw[u]] -= nbytes[u]
                    uw[u] = -1
            uw[unit] = worker
            load[worker] += nbytes[unit]
            for i in range(k, n):
                wn[i] = uw[of[i]]
            st = tl.state(k)
        fin, free, copies, joins = st.fin, st.free, st.copies, tl.joins
        for i in range(k, n):
            u = of[i]
            if uw[u] < 0:
                best = None
                for w in self.free_workers:
                    if load[w] + nbytes[u] > room[w]:
                        continue
                    t, local, pen = free[w], 0, 0.0
                    for p, s, key, nb in ins[i]:
                        if p >= 0:
                            s, r = wn[p], fin[p]
                        else:
                            r = 0.0
                        if s != w:
                            c = copies.get(key + w)
                            if c is not None:
                                r = c[0]
                            else:  # a message's latency, unless it joins an open one
                                x = nb * ibw[s][w]
                                if not (coalesce and joins(p, s, w, st)):
                                    x += lat[s][w]
                                if shared:  # one machine: the copy's time adds up
                                    t += x
                                else:
                                    r += x
                                pen += x
                        else:
                            local += nb
                        if r > t:
                            t = r
                    t += alpha * pen
                    # Data this unit's later nodes read, or fixed units read from it: one
                    # message per other worker (a bit per worker in `linked`) if coalescing.
                    linked = 0
                    for p, s, nb in later[u]:
                        src = wn[p] if p >= 0 else s
                        if src >= 0 and src != w:
                            t += nb * ibw[src][w]
                            if not linked >> src & 1:
                                t += lat[src][w]
                                linked |= coalesce << src
                    linked = 0
                    for dst, nb in pushed[u]:
                        if dst != w:
                            t += nb * ibw[w][dst]
                            if not linked >> dst & 1:
                                t += lat[w][dst]
                                linked |= coalesce << dst
                    score = (t + ct[i][w], -local)
                    if best is None or score < best[0]:
                        best = (score, w)
                if best is None:
                    raise PlacementError(
                        f"no worker has room for the {nbytes[u]} bytes that "
                        f"{_where(tl.nodes[i])} creates under the memory cap; raise the cap "
                        "or add workers"
                    )
                uw[u] = w = best[1]
                load[w] += nbytes[u]
                for j in units.members[u]:
                    wn[j] = w
            t = tl.advance(i, wn, st)
            if t > bound:
                tl.steps += 4 * (i + 1 - k)  # scoring every worker: about four plain steps
                return uw, t
        tl.steps += 4 * (n - k)
        return uw, max(free, default=0.0)

    def _affinity(self) -> tuple[list[list[tuple]], list[list[tuple]]]:
        """Per unit: inputs of its nodes after the first that come from outside the unit
        (producer, stored worker, bytes), and values it makes that fixed units elsewhere
        read (worker, bytes)."""
        tl, units = self.tl, self.units
        later: list[list[tuple]] = [[] for _ in units.members]
        pushed: list[list[tuple]] = [[] for _ in units.members]
        seen: set[tuple[int, int]] = set()
        for u, members in enumerate(units.members):
            for i in members[1:]:
                for p, s, key, nbytes in tl.ins[i]:
                    if (p < 0 or units.of[p] != u) and (u, key) not in seen:
                        seen.add((u, key))
                        later[u].append((p, s, nbytes))
        for i, row in enumerate(tl.ins):
            dst = self.fixed[units.of[i]]
            if dst < 0:
                continue
            for p, _, key, nbytes in row:
                if p >= 0 and self.fixed[units.of[p]] < 0 and (-1 - dst, key) not in seen:
                    seen.add((-1 - dst, key))
                    pushed[units.of[p]].append((dst, nbytes))
        return later, pushed

    def refine(self, uw: list[int], steps: int) -> tuple[list[int], float, int, int]:
        """Improve `uw` by moves while the finish time drops and `steps` last; returns the
        assignment, its finish time and bytes moved, and the steps left.

        A move takes one unit to another worker, either alone or followed by a greedy
        roll-out of every unit decided after it (which moves a whole branch with it). The
        units on the critical path come first: only they can shorten the finish time.
        """
        tl, units = self.tl, self.units
        n = len(tl.ins)
        budget = tl.steps + steps
        wn = self.expand(uw)
        best, best_bytes = tl.run(wn, keep=True), tl.bytes_moved(wn)
        load = self.load(uw)
        improved = True
        while improved and tl.steps < budget:
            improved = False
            tl.steps += n  # the critical path
            for u in self._critical_units(wn):
                k = self.first[u]
                for w in self.free_workers:
                    here = uw[u]
                    if w == here or tl.steps >= budget:
                        continue
                    if load[w] + units.nbytes[u] > self.room[w]:
                        continue
                    tl.steps += n // 20  # copying the state at k
                    bound = best * (1 + 1e-9)
                    try:
                        roll, t_roll = self.greedy((uw, wn, load, u, w), bound)
                    except PlacementError:  # the roll-out ran out of memory: no move
                        roll, t_roll = uw, math.inf
                    for i in units.members[u]:
                        wn[i] = w
                    t = tl.rerun(wn, k, bound)
                    for i in units.members[u]:
                        wn[i] = here
                    moved = list(uw)
                    moved[u] = w
                    options = sorted([(t_roll, roll), (t, moved)], key=lambda c: c[0])
                    for t_new, uw_new in options:
                        if t_new > bound:
                            break
                        # Better, or as good and moving fewer bytes.
                        wn_new = self.expand(uw_new)
                        b = tl.bytes_moved(wn_new)
                        tl.steps += n // 2
                        if t_new < best * (1 - 1e-9) or b < best_bytes:
                            uw, wn, load = uw_new, wn_new, self.load(uw_new)
                            best, best_bytes, improved = tl.run(wn, keep=True), b, True
                            break
        steps = budget - tl.steps
        return uw, best, best_bytes, steps

    def _critical_units(self, wn: list[int]) -> list[int]:
        """Free units along the critical path of the kept run, latest first, then the rest
        in recording order when the graph is small enough to try them all."""
        tl, units = self.tl, self.units
        fin, copies = tl.kept()
        n = len(tl.ins)
        prev_on = [-1] * n  # the node before each on its worker
        last = [-1] * len(tl.workers)
        for i, w in enumerate(wn):
            prev_on[i], last[w] = last[w], i
        path: list[int] = []
        i = max(range(n), key=fin.__getitem__)
        while i >= 0:
            path.append(i)
            w = wn[i]
            start = fin[i] - tl.ct[i][w]
            nxt = prev_on[i]
            for p, s, key, _ in tl.ins[i]:
                src = wn[p] if p >= 0 else s
                r = (fin[p] if p >= 0 else 0.0) if src == w else copies[key + w][0]
                if r >= start * (1 - 1e-12) and r > 0:
                    nxt = p  # waited for this input (its producer, or stored data: -1)
                    break
            else:
                if prev_on[i] < 0 or fin[prev_on[i]] < start * (1 - 1e-12):
                    nxt = -1
            i = nxt
        order = list(dict.fromkeys(units.of[i] for i in path))
        if len(units.members) * n <= 200_000:
            order += sorted(set(range(len(units.members))) - set(order))
        return [u for u in order if self.fixed[u] < 0]
