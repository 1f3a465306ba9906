"""Synthetic graphs for placement tests and benchmarks, built without workers.

`Builder` makes `Node`s and `Value`s directly, with real ATen ops (so `Node.name`, the
schema's aliasing and the meta-device shapes are what tracing would record): stored tensors
have a `location`, views and in-place results share their input's storage.
"""

from __future__ import annotations

import itertools
import random

import networkx as nx
import torch

from gridgraph.trace.graph import Node, Ref, Value
from gridgraph.trace.meta import TensorMeta
from gridgraph.trace.record import aliasing

aten = torch.ops.aten
WORKERS = ["w0", "w1", "w2"]


class Builder:
    """Append nodes in recording order; every tensor is a `Ref` to a value id."""

    def __init__(self) -> None:
        self.values: dict[int, Value] = {}
        self.nodes: list[Node] = []
        self._ids = itertools.count(1)

    def stored(self, shape: tuple[int, ...], worker: str) -> Ref:
        vid = next(self._ids)
        meta = TensorMeta.of(torch.empty(shape, device="meta"))
        self.values[vid] = Value(vid, meta, vid, location=worker)
        return Ref(vid)

    def __call__(self, op: torch._ops.OpOverload, *args, pin: str | None = None) -> Ref:
        """Record op(*args); returns its result (a tuple of them for a multi-output op)."""
        out = op(*[self.values[a.value].meta.on_meta() if type(a) is Ref else a for a in args])
        outs = [o for o in out if o is not None] if isinstance(out, tuple) else [out]
        nid = next(self._ids)
        alias = aliasing(op)
        refs = []
        for i, o in enumerate(outs):
            vid = next(self._ids)
            src, _ = alias.returns[min(i, len(alias.returns) - 1)]
            storage = self.values[args[src].value].storage if src is not None else vid
            self.values[vid] = Value(vid, TensorMeta.of(o), storage, producer=nid)
            refs.append(Ref(vid))
        writes = tuple((i, args[i].value) for i in alias.written)
        meta = {"where": f"graphs.py:{len(self.nodes) + 1}"}
        if pin is not None:
            meta["pin"] = pin
        outputs = tuple(r.value for r in refs)
        kind = "tuple" if isinstance(out, tuple) else "tensor"
        self.nodes.append(Node(nid, op, tuple(args), {}, outputs, kind, len(refs), writes, meta))
        return tuple(refs) if isinstance(out, tuple) else refs[0]


def chain(sizes: list[int], workers: list[str] = WORKERS) -> Builder:
    """x @ W1 -> relu -> @ W2 -> relu ...: x on workers[0], weight i on workers[i % n]."""
    b = Builder()
    h = b.stored((32, sizes[0]), workers[0])
    for i, (k, n) in enumerate(itertools.pairwise(sizes)):
        h = b(aten.relu.default, b(aten.mm.default, h, b.stored((k, n), workers[i % len(workers)])))
    b(aten.sum.default, h)
    return b


def far_weight_chain(small_weight: bool) -> Builder:
    """A chain over x (1 MB on w0) that needs one weight from w1.

    With a small weight (1 KB), the fewest bytes move that weight; with a big one (4 MB), the
    chain first reduces x to 4 KB and moves that instead.
    """
    b = Builder()
    x = b.stored((1024, 256), "w0")
    if small_weight:
        h = b(aten.relu.default, b(aten.mm.default, x, b.stored((256, 1), "w1")))
    else:
        h = b(aten.sum.dim_IntList, b(aten.relu.default, x), [1], True)
        h = b(aten.mm.default, b(aten.t.default, h), b.stored((1024, 1024), "w1"))
    b(aten.sum.default, b(aten.relu.default, h))
    return b


def two_tower(d: int = 256, depth: int = 4, workers: list[str] = WORKERS) -> Builder:
    """Two independent mm towers over one input (weights on w1 and w2), joined by a sum."""
    b = Builder()
    x = b.stored((d, d), workers[0])
    towers = []
    for w in workers[1:3]:
        h = x
        for _ in range(depth):
            h = b(aten.relu.default, b(aten.mm.default, h, b.stored((d, d), w)))
        towers.append(h)
    b(aten.sum.default, b(aten.add.Tensor, *towers))
    return b


def residual_cnn(
    channels: int = 16, blocks: int = 3, hw: int = 16, workers: list[str] = WORKERS
) -> Builder:
    """conv -> relu -> conv -> + skip, per block; block i's weights on workers[i % n]."""
    b = Builder()
    x = b.stored((8, channels, hw, hw), workers[0])
    conv = aten.convolution.default
    for i in range(blocks):
        w = workers[i % len(workers)]
        k1, k2 = (b.stored((channels, channels, 3, 3), w) for _ in range(2))
        h = b(aten.relu.default, b(conv, x, k1, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1))
        h = b(conv, h, k2, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
        x = b(aten.relu_.default, b(aten.add.Tensor, h, x))  # in place: one alias unit
    b(aten.sum.default, b(aten.view.default, x, [-1]))
    return b


def random_dag(
    n: int, seed: int, d: int = 128, window: int = 8, workers: list[str] = WORKERS
) -> Builder:
    """A random DAG of `n` ops over (d, d) tensors, each reading 1-2 recent results.

    The structure is a networkx DiGraph (edges from earlier to later ops within `window`);
    ops are mm with a stored weight, add, relu, mul, transposes (views) and in-place relu_.
    """
    rng = random.Random(seed)
    dag = nx.DiGraph()
    for j in range(n):
        dag.add_node(j)
        if j == 0 or rng.random() < 0.05:
            continue  # a new source: starts from a stored tensor
        for i in rng.sample(range(max(0, j - window), j), min(j - max(0, j - window), 2)):
            if rng.random() < 0.7 or dag.in_degree(j) == 0:
                dag.add_edge(i, j)
    b = Builder()
    weights = [b.stored((d, d), workers[i % len(workers)]) for i in range(2 * len(workers))]
    out: dict[int, Ref] = {}
    consumed: set[int] = set()
    for j in range(n):
        preds = sorted(dag.predecessors(j))
        ins = [out[i] for i in preds] or [rng.choice(weights)]
        kind = rng.random()
        if len(ins) == 2:
            op = aten.add.Tensor if kind < 0.6 else aten.mul.Tensor
            out[j] = b(op, *ins)
        elif kind < 0.45:
            out[j] = b(aten.mm.default, ins[0], rng.choice(weights))
        elif kind < 0.65:
            out[j] = b(aten.relu.default, ins[0])
        elif kind < 0.8:
            out[j] = b(aten.t.default, ins[0])
        elif kind < 0.9 and preds and preds[0] not in consumed and dag.out_degree(preds[0]) == 1:
            out[j] = b(aten.relu_.default, ins[0])  # the only reader of its input: in place
        else:
            out[j] = b(aten.mul.Tensor, ins[0], ins[0])
        consumed.update(preds)
    return b
