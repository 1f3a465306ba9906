"""The cost model placement optimizes: how long a placed graph takes to run.

An op takes its estimated FLOPs over its worker's throughput. Values move between workers in
messages, as `plan.split` groups them: everything a worker sends another from one of its
stages travels in one message (see plan.py), so a message costs the link's latency once and
its bytes at the link's bandwidth. A value another worker needs is copied there once however
many ops there read it. It joins the latest message from its worker to that one for the
stage it was made in if it was made before that message's first reader in recording order,
or if its worker ran only views since that message's latest value (plan.py's rules (a)
and (b)); else it opens a new message, which arrives
`latency + nbytes / bandwidth` after the value is ready (at time 0 if it is already stored).
A value joining a message arrives with the whole message: when its last value so far is
ready, plus the latency, plus all its bytes over the bandwidth (the message's earlier readers
are not delayed again: an approximation, exact when the workers share one machine, where only
the sum of the times counts). Each worker runs its
ops in recording order, as the programs of `plan.split` do, starting each as soon as the
worker is free and its inputs are there. The estimated finish time of the whole graph is the
objective `place` minimizes and `finish_time` reports.

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

from gridgraph.schedule.plan import makes_views
from gridgraph.trace.graph import Const, Node, Ref, Value
from gridgraph.trace.work import convolution_macs, inner_dim


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
        return cls(**{"latency": 10e-3, "bandwidth": 1e8, **kw})

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
# Products' and convolutions' multiply-adds are counted by trace/work.py, as a worker's time
# bound counts them (exec/safety/limits.op_work); what ops cost beyond that is placement's own.

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
    if name in _FREE or makes_views(node, values):  # (views: no work)
        return 0.0
    biggest = 0
    for vid in (*node.inputs(), *node.outputs):
        v = values.get(vid)
        if v is not None:
            biggest = max(biggest, math.prod(v.meta.shape))
    return float(_HEAVY.get(name, 1) * biggest)


def _product_flops(node: Node, name: str, values: Mapping[int, Value]) -> float:
    outs = [values[v].meta.shape for v in node.outputs if v in values]
    ins: list[tuple[int, ...]] = []
    _arg_shapes(node.args, values, ins)
    _arg_shapes(tuple(node.kwargs.values()), values, ins)
    if name in _MATMUL:
        if len(ins) <= _MATMUL[name] or not outs:
            return 0.0
        k = inner_dim(node.op._schema.name, ins)
        return 2.0 * math.prod(outs[0]) * k + (math.prod(outs[0]) if _MATMUL[name] else 0)
    backward = name.endswith("backward")
    if len(ins) < 2 + backward:
        return 0.0
    x, w = (ins[1], ins[2]) if backward else (ins[0], ins[1])
    y = ins[0] if backward else (outs[0] if outs else x)
    transposed = _flag(node.args, 7 if backward else 6)
    forward = 2.0 * convolution_macs(x, w, y, transposed)
    if not backward:
        return forward
    mask = node.args[10] if len(node.args) > 10 else [True, True, True]
    return forward * (bool(mask[0]) + bool(mask[1])) + math.prod(y) * bool(mask[2])


def _flag(args: tuple, index: int) -> bool:
    return bool(args[index]) if len(args) > index and isinstance(args[index], bool) else False


# --- the simulation -----------------------------------------------------------------------


class SimState:
    """The simulation after a prefix of the nodes (mutable; `Timeline.advance` moves it on).

    fin        finish time of each node simulated so far
    stage_of   the stage of each node (a worker's stage grows where it receives a message
               from a worker whose stage is not behind its own, as in plan.split)
    busy_of    messages each node's worker had received and ops other than views it had run
               when it ran (itself included)
    free       when each worker is next free
    stage      each worker's current stage
    busy       the same count for each worker
    copies     value copies made: value key * W + worker -> (arrival time, node that made it)
    msgs       the latest message of each (src's stage, src, dst), keyed
               stage * W * W + src * W + dst -> (first reader, send time, bytes, node that
               made this record, the record it replaced, the node that made its latest
               value or -1): a chain, so that the state before any node can be recovered
    """

    __slots__ = ("fin", "stage_of", "busy_of", "free", "stage", "busy", "copies", "msgs")

    def __init__(self, fin, stage_of, busy_of, free, stage, busy, copies, msgs) -> None:
        self.fin, self.stage_of, self.busy_of = fin, stage_of, busy_of
        self.free, self.stage, self.busy = free, stage, busy
        self.copies, self.msgs = copies, msgs

    def resumed(self, at: tuple[list, list, list], copies: dict, msgs: dict) -> SimState:
        """A copy of this state's per-node lists, with the workers' state `at` (free times,
        stages, busy counts) and the given copies and messages."""
        free, stage, busy = at
        return SimState(self.fin.copy(), self.stage_of.copy(), self.busy_of.copy(), list(free),
                        list(stage), list(busy), copies, msgs)  # fmt: skip

    def workers(self) -> tuple[list, list, list]:
        return self.free.copy(), self.stage.copy(), self.busy.copy()


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
        self.work = [0 if makes_views(n, values) else 1 for n in nodes]  # see SimState.busy
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
        W = self.W = len(self.workers)
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

    def start(self) -> SimState:
        """The state before the first node."""
        n, W = len(self.ins), len(self.workers)
        return SimState([0.0] * n, [0] * n, [0] * n, [0.0] * W, [0] * W, [0] * W, {}, {})

    def run(self, wn: list[int], keep: bool = False) -> float:
        """Estimated finish time of the graph placed by `wn`."""
        st = self.start()
        at = [] if keep else None
        t = self._simulate(wn, 0, st, st, at)
        if keep:
            self._kept = (list(wn), st, at, t)
        return t

    def rerun(self, wn: list[int], k: int, bound: float = math.inf) -> float:
        """`run(wn)`, reusing the kept run for nodes before k. Stops early with a time over
        `bound` once some node finishes after it: the whole graph cannot finish sooner."""
        _, kept, at, _ = self._kept
        if k >= len(self.ins):
            return max(at[-1][0]) if at else 0.0
        return self._simulate(wn, k, kept.resumed(at[k], {}, {}), kept, None, bound)

    def kept(self) -> tuple[list[float], dict[int, tuple[float, int]]]:
        """(finish time of each node, copies made: key -> (arrival, node)) of the kept run."""
        _, st, _, _ = self._kept
        return st.fin, st.copies

    def state(self, k: int) -> SimState:
        """The kept run's state just before node k, fresh (lists and dicts of its own), to
        continue the simulation from k with another placement of the nodes from k on."""
        _, kept, at, _ = self._kept
        copies = kept.copies.copy()
        late = []  # dicts keep insertion order: the copies made from k on are at the end
        for c in reversed(copies):
            if copies[c][1] < k:
                break
            late.append(c)
        for c in late:
            del copies[c]
        msgs = {}
        for key, m in kept.msgs.items():
            while m is not None and m[3] >= k:
                m = m[4]
            if m is not None:
                msgs[key] = m
        return kept.resumed(at[k], copies, msgs)

    def _simulate(self, wn, k, st, old, at, bound=math.inf) -> float:
        # `old` holds copies and messages made by an earlier run (with the node that made
        # them); those made before k are still valid. New ones go to `st` (the same state on
        # a full run). `at`, if a list, gets the workers' state before each node.
        for i in range(k, len(self.ins)):
            if at is not None:
                at.append(st.workers())
            t = self.advance(i, wn, st, old, k)
            if t > bound:
                self.steps += i + 1 - k
                return t
        self.steps += len(self.ins) - k
        if at is not None:
            at.append(st.workers())
        return max(st.free) if st.free else 0.0

    def advance(self, i: int, wn: list[int], st: SimState, old: SimState | None = None,
                k: int = 0) -> float:  # fmt: skip
        """Run node i on worker wn[i] after nodes 0..i-1: make the copies of its inputs it
        needs (reusing those in `st`, or those in `old` made before node k), each joining or
        opening a message; set its finish time and its worker's next free time and stage;
        returns the finish time."""
        lat, ibw, W = self.lat, self.ibw, self.W
        fin, free, copies, msgs = st.fin, st.free, st.copies, st.msgs
        old = old or st
        w = wn[i]
        t = free[w]
        stage, busy, busy_of = st.stage[w], st.busy[w] + self.work[i], st.busy_of
        for p, s, key, nbytes in self.ins[i]:
            if p >= 0:
                s = wn[p]
                r = fin[p]
            else:
                r = 0.0
            if s == w:
                if r > t:
                    t = r
                continue
            c = old.copies.get(key + w)
            if c is None or c[1] >= k:
                c = copies.get(key + w)
            if c is None:
                s_src = st.stage_of[p] if p >= 0 else 0
                mk = (s_src * W + s) * W + w
                m = msgs.get(mk)
                if m is None and old is not st:
                    m = old.msgs.get(mk)
                    while m is not None and m[3] >= k:
                        m = m[4]
                if m is not None and (
                    p < m[0]  # made before the message's first reader: (a)
                    or p <= m[5]
                    or busy_of[p] == (busy_of[m[5]] if m[5] >= 0 else 0)  # views since: (b)
                ):
                    send, size = max(m[1], r), m[2] + nbytes
                    m = (m[0], send, size, i, m, max(m[5], p))
                    if self.shared:  # one machine: the bytes take their time now
                        t += nbytes * ibw[s][w]
                        c = (t, i)
                    else:
                        c = (send + lat[s][w] + size * ibw[s][w], i)
                else:
                    m = (i, r, nbytes, i, m, p)
                    busy += 1
                    if s_src >= stage:
                        stage = s_src + 1
                    if self.shared:  # one machine: the message takes its time now
                        t += lat[s][w] + nbytes * ibw[s][w]
                        c = (t, i)
                    else:
                        c = (r + lat[s][w] + nbytes * ibw[s][w], i)
                msgs[mk] = m
                copies[key + w] = c
            r = c[0]
            if r > t:
                t = r
        t += self.ct[i][w]
        fin[i] = t
        st.stage_of[i] = st.stage[w] = stage
        busy_of[i] = st.busy[w] = busy
        if self.shared:
            free[:] = [t] * len(free)
        else:
            free[w] = t
        return t

    def messages(self, wn: list[int]) -> int:
        """Messages the graph placed by `wn` sends between workers (`plan.split`'s sends)."""
        st = self.start()
        self._simulate(wn, 0, st, st, None)
        opened = 0
        for m in st.msgs.values():
            while m is not None:  # a record with a new first reader opened a message
                opened += m[4] is None or m[4][0] != m[0]
                m = m[4]
        return opened

    def joins(self, p: int, s: int, w: int, st: SimState) -> bool:
        """Whether a copy of a value made by node p (or stored: p < 0) on worker s would join
        a message already open to worker w."""
        s_src = st.stage_of[p] if p >= 0 else 0
        m = st.msgs.get((s_src * self.W + s) * self.W + w)
        if m is None:
            return False
        busy_of = st.busy_of
        return p < m[0] or p <= m[5] or busy_of[p] == (busy_of[m[5]] if m[5] >= 0 else 0)

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
