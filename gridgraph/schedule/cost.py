"""The cost model placement optimizes: how long a placed graph takes to run.

An op takes its estimated FLOPs over its worker's throughput. A value another worker needs
arrives `latency + nbytes / bandwidth` after its producer finishes (or at time 0 plus that if
it is already stored), once per destination worker however many ops there read it:
`plan.split` sends a value right after the step that made it current. Each worker runs its ops
in recording order, as the programs of `plan.split` do, starting each as
soon as the worker is free and its inputs are there. The estimated finish time of the whole
graph is the objective `place` minimizes and `finish_time` reports.

`Timeline` is that simulation compiled once into flat arrays, so the placement search can
evaluate thousands of candidate placements of the same graph, and re-run only the suffix after
the first node a move changes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache

import torch

from gridgraph.trace.graph import Const, Node, Ref, Value


@dataclass(frozen=True)
class CostModel:
    """Throughput per worker, and bandwidth and per-message latency per link.

    >>> cost = CostModel.pubsub()
    >>> cost.transfer_time(1_000_000, "w0", "w1")  # 10 ms latency + 1 MB at 100 MB/s
    0.02
    """

    flops: float = 5e10  # FLOP/s of a worker not named in `worker_flops`
    bandwidth: float = 5e9  # bytes/s of a link not named in `links`
    latency: float = 50e-6  # seconds per message
    worker_flops: Mapping[str, float] = field(default_factory=dict)
    links: Mapping[tuple[str, str], tuple[float, float]] = field(default_factory=dict)
    # (src, dst) -> (bandwidth, latency) for links that differ from the default
    shared: bool = False
    # True: the workers share one machine's cores (in-process workers), so nothing runs in
    # parallel: every op and every transfer takes its time one after another.

    @classmethod
    def local(cls, **kw) -> CostModel:
        """In-process workers: a message is a hand-off plus a copy of its tensors. They share
        this process's cores (and each op already uses all of them), so running branches on
        several of them gains nothing and every transfer is time added: fewest transfers win."""
        return cls(**{"shared": True, "latency": 200e-6, "bandwidth": 2e9, **kw})

    @classmethod
    def pubsub(cls, **kw) -> CostModel:
        """Workers over IPFS PubSub: every message is a round of gossip."""
        return cls(latency=10e-3, bandwidth=1e8, **kw)

    def speed(self, worker: str) -> float:
        return self.worker_flops.get(worker, self.flops)

    def link(self, src: str, dst: str) -> tuple[float, float]:
        """(bandwidth, latency) from src to dst."""
        return self.links.get((src, dst), (self.bandwidth, self.latency))

    def compute_time(self, flops: float, worker: str) -> float:
        return flops / self.speed(worker)

    def transfer_time(self, nbytes: int, src: str, dst: str) -> float:
        bandwidth, latency = self.link(src, dst)
        return latency + nbytes / bandwidth


# --- FLOPs of one op ------------------------------------------------------------------------

# Matrix products, and the argument index of their left matrix.
_MATMUL = {"mm": 0, "bmm": 0, "matmul": 0, "mv": 0, "dot": 0, "vdot": 0, "linear": 0,
           "addmm": 1, "baddbmm": 1, "addbmm": 1, "addmv": 1}  # fmt: skip
# Ops that move or allocate memory without arithmetic worth counting.
_FREE = {"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided",
         "_unsafe_view", "lift_fresh", "alias"}  # fmt: skip
# Ops that do a few passes over their input: mean/variance, exp and a sum, ...
_HEAVY = {"_softmax": 5, "_log_softmax": 5, "_softmax_backward_data": 4,
          "_log_softmax_backward_data": 4, "native_layer_norm": 8,
          "native_layer_norm_backward": 10, "native_batch_norm": 8,
          "_native_batch_norm_legit_functional": 8, "native_batch_norm_backward": 10,
          "max_pool2d_with_indices": 9, "avg_pool2d": 9, "gelu": 8, "tanh": 4,
          "sigmoid": 4}  # fmt: skip


@cache
def _base(op: torch._ops.OpOverload) -> str:
    """aten.add_.Tensor -> 'add_'."""
    return op._schema.name.split("::", 1)[-1]


def _arg_shapes(obj, values: Mapping[int, Value], out: list[tuple[int, ...]]) -> None:
    for a in obj:
        if type(a) is Ref:
            v = values.get(a.value)
            out.append(v.meta.shape if v is not None else ())
        elif type(a) is Const:
            out.append(tuple(a.tensor.shape))
        elif isinstance(a, (list, tuple)):
            _arg_shapes(a, values, out)


def estimate_flops(node: Node, values: Mapping[int, Value]) -> float:
    """Floating point operations of one recorded op, from its name and tensor shapes.

    Matrix products count 2*M*N*K, convolutions 2 * output * (input channels per group) *
    kernel, their backward twice that per requested gradient; views cost nothing; every
    other op a few FLOPs per element of its largest remote input or output.

    >>> estimate_flops(node_of_mm_64x32_by_32x8, values)  # 2 * 64 * 8 * 32
    32768.0
    """
    name = _base(node.op)
    if name in _MATMUL or "convolution" in name:
        return _product_flops(node, name, values)
    if name in _FREE:
        return 0.0
    biggest, read = 0, set()
    for vid in node.inputs():
        v = values.get(vid)
        if v is not None:
            read.add(v.storage)
            biggest = max(biggest, math.prod(v.meta.shape))
    view = not node.writes
    for vid in node.outputs:
        v = values.get(vid)
        if v is not None:
            view = view and v.storage in read
            biggest = max(biggest, math.prod(v.meta.shape))
    if view and node.outputs:  # every output shares its storage with an input: no work
        return 0.0
    return float(_HEAVY.get(name, 1) * biggest)


def _product_flops(node: Node, name: str, values: Mapping[int, Value]) -> float:
    outs = [values[v].meta.shape for v in node.outputs if v in values]
    ins: list[tuple[int, ...]] = []
    _arg_shapes(node.args, values, ins)
    _arg_shapes(tuple(node.kwargs.values()), values, ins)
    if name in _MATMUL:
        if len(ins) <= _MATMUL[name] or not outs:
            return 0.0
        left = ins[_MATMUL[name]]
        k = left[-1] if left else 1
        return 2.0 * math.prod(outs[0]) * k + (math.prod(outs[0]) if _MATMUL[name] else 0)
    backward = name.endswith("backward")
    if len(ins) < 2 + backward:
        return 0.0
    x, w = (ins[1], ins[2]) if backward else (ins[0], ins[1])
    y = ins[0] if backward else (outs[0] if outs else x)
    transposed = _flag(node.args, 7 if backward else 6)
    per_point = 2.0 * (w[1] if len(w) > 1 else 1) * math.prod(w[2:])
    forward = per_point * math.prod(x if transposed else y)
    if not backward:
        return forward
    mask = node.args[10] if len(node.args) > 10 else [True, True, True]
    return forward * (bool(mask[0]) + bool(mask[1])) + math.prod(y) * bool(mask[2])


def _flag(args: tuple, index: int) -> bool:
    return bool(args[index]) if len(args) > index and isinstance(args[index], bool) else False


# --- the simulation -----------------------------------------------------------------------


_NO_COPIES: dict = {}  # `advance` without copies from an earlier run


class Timeline:
    """The finish-time simulation of one graph, compiled to flat arrays.

    A placement is a list `wn` of worker indices, one per node in recording order. `run(wn)`
    returns the estimated finish time; `run(wn, keep=True)` also keeps the per-node state so
    that `rerun(wn, k)` re-simulates only from node k on (every node before k must be placed
    as in the kept run).
    """

    def __init__(
        self,
        nodes: list[Node],
        values: Mapping[int, Value],
        workers: list[str],
        cost: CostModel | None = None,
    ) -> None:
        cost = cost or CostModel()
        self.nodes = nodes
        self.flops = [estimate_flops(n, values) for n in nodes]
        producer = {v: i for i, n in enumerate(nodes) for v in n.outputs}
        # Per node, its distinct inputs as (producer index or -1, stored worker, value, bytes).
        self.key_of: dict[int, int] = {}
        rows: list[list[tuple]] = []
        stored_on: dict[str, None] = {}  # workers holding inputs, in order of first use
        for n in nodes:
            row = []
            for vid in dict.fromkeys(n.inputs()):
                key = self.key_of.get(vid)
                if key is None:
                    key = self.key_of[vid] = len(self.key_of)
                v = values.get(vid)
                p = producer.get(vid, -1)
                if p < 0 and (v is None or v.location is None):
                    raise ValueError(
                        f"value %{vid} read by {n.name} (recorded at "
                        f"{n.meta.get('where', '<unknown>')}) is neither stored on a worker "
                        "nor produced by the graph being placed"
                    )
                location = None if p >= 0 else v.location
                if location is not None:
                    stored_on[location] = None
                row.append((p, location, key, v.meta.nbytes if v is not None else 0))
            rows.append(row)
        # Workers: those given, then any other that holds data or is named by a pin.
        self.workers = list(workers)
        extra = {**stored_on, **{n.meta["pin"]: None for n in nodes if "pin" in n.meta}}
        self.workers += [w for w in extra if w not in self.workers]
        self.index = {w: i for i, w in enumerate(self.workers)}
        W = len(self.workers)
        self.speed = [cost.speed(w) for w in self.workers]
        links = [[cost.link(s, d) for d in self.workers] for s in self.workers]
        self.lat = [[lat for _, lat in row] for row in links]
        self.ibw = [[1.0 / bw for bw, _ in row] for row in links]
        self.ct = [[f / s for s in self.speed] for f in self.flops]
        self.shared = cost.shared
        index = self.index
        # A copy of value k on worker w is keyed k * W + w: one flat int per (value, worker).
        self.ins: list[tuple[tuple[int, int, int, int], ...]] = [
            tuple((p, -1 if s is None else index[s], k * W, b) for p, s, k, b in row)
            for row in rows
        ]
        self._kept: tuple | None = None
        self.steps = 0  # nodes simulated so far: what searches budget their work in

    def run(self, wn: list[int], keep: bool = False) -> float:
        """Estimated finish time of the graph placed by `wn`."""
        fin = [0.0] * len(self.ins)
        free = [0.0] * len(self.workers)
        copies: dict[int, tuple[float, int]] = {}
        free_at = [] if keep else None
        t = self._simulate(wn, 0, fin, free, copies, copies, free_at)
        if keep:
            self._kept = (list(wn), fin, free_at, copies, t)
        return t

    def rerun(self, wn: list[int], k: int, bound: float = math.inf) -> float:
        """`run(wn)`, reusing the kept run for nodes before k. Stops early with a time over
        `bound` once some node finishes after it: the whole graph cannot finish sooner."""
        _, fin0, free_at, copies0, _ = self._kept
        if k >= len(self.ins):
            return max(free_at[-1]) if free_at else 0.0
        fin = fin0.copy()
        return self._simulate(wn, k, fin, list(free_at[k]), copies0, {}, None, bound)

    def kept(self) -> tuple[list[float], dict[int, tuple[float, int]]]:
        """(finish time of each node, copies made: key -> (arrival, node)) of the kept run."""
        _, fin, _, copies, _ = self._kept
        return fin, copies

    def state(self, k: int) -> tuple[list[float], list[float], dict[int, tuple[float, int]]]:
        """(finish times, worker free times, copies) of the kept run just before node k;
        the lists and dict are fresh, to continue the simulation from k with another
        placement of the nodes from k on."""
        _, fin, free_at, copies, _ = self._kept
        copies = copies.copy()
        late = []  # dicts keep insertion order: the copies made from k on are at the end
        for c in reversed(copies):
            if copies[c][1] < k:
                break
            late.append(c)
        for c in late:
            del copies[c]
        return fin.copy(), list(free_at[k]), copies

    def _simulate(self, wn, k, fin, free, old, copies, free_at, bound=math.inf) -> float:
        # `old` holds copies made by an earlier run (with the node that made them); those made
        # before k are still valid. New copies go to `copies` (the same dict on a full run).
        for i in range(k, len(self.ins)):
            if free_at is not None:
                free_at.append(free.copy())
            t = self.advance(i, wn, fin, free, copies, old, k)
            if t > bound:
                self.steps += i + 1 - k
                return t
        self.steps += len(self.ins) - k
        if free_at is not None:
            free_at.append(free.copy())
        return max(free) if free else 0.0

    def advance(self, i, wn, fin, free, copies, old=_NO_COPIES, k=0) -> float:
        """Run node i on worker wn[i] after nodes 0..i-1: make the copies of its inputs it
        needs (reusing those in `copies`, or those in `old` made before node k), set its
        finish time and its worker's next free time; returns the finish time."""
        lat, ibw = self.lat, self.ibw
        w = wn[i]
        t = free[w]
        for p, s, key, nbytes in self.ins[i]:
            if p >= 0:
                s = wn[p]
                r = fin[p]
            else:
                r = 0.0
            if s != w:
                c = old.get(key + w)
                if c is None or c[1] >= k:
                    c = copies.get(key + w)
                if c is None:
                    if self.shared:  # one machine: the copy takes its time now
                        t += lat[s][w] + nbytes * ibw[s][w]
                        c = (t, i)
                    else:
                        c = (r + lat[s][w] + nbytes * ibw[s][w], i)
                    copies[key + w] = c
                r = c[0]
            if r > t:
                t = r
        t += self.ct[i][w]
        fin[i] = t
        if self.shared:
            free[:] = [t] * len(free)
        else:
            free[w] = t
        return t

    def bytes_moved(self, wn: list[int]) -> int:
        """Bytes sent between workers: each value once per worker that reads it elsewhere."""
        sent: set[int] = set()
        total = 0
        for i, row in enumerate(self.ins):
            w = wn[i]
            for p, s, key, nbytes in row:
                if (wn[p] if p >= 0 else s) != w and key + w not in sent:
                    sent.add(key + w)
                    total += nbytes
        return total

    def encode(self, placement: Mapping[int, str]) -> list[int]:
        """Node id -> worker name, as a list of worker indices in recording order."""
        return [self.index[placement[n.id]] for n in self.nodes]

    def decode(self, wn: list[int]) -> dict[int, str]:
        return {n.id: self.workers[w] for n, w in zip(self.nodes, wn)}


def _workers_of(nodes: list[Node], placement: Mapping[int, str]) -> list[str]:
    return sorted({placement[n.id] for n in nodes})


def finish_time(
    nodes: list[Node],
    values: Mapping[int, Value],
    placement: Mapping[int, str],
    cost: CostModel | None = None,
) -> float:
    """Estimated seconds from start until every node of the placed graph has finished.

    >>> finish_time(nodes, graph.values, naive_placement(nodes, graph.values), CostModel.local())
    0.000161
    """
    tl = Timeline(nodes, values, _workers_of(nodes, placement), cost)
    return tl.run(tl.encode(placement))


def bytes_moved(
    nodes: list[Node], values: Mapping[int, Value], placement: Mapping[int, str]
) -> int:
    """Bytes the placed graph sends between workers; equals `split(...).bytes_moved`."""
    tl = Timeline(nodes, values, _workers_of(nodes, placement))
    return tl.bytes_moved(tl.encode(placement))
