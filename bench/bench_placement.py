"""Placement quality and compile time on a suite of graphs (a benchmark, not a test).

Run: python bench/bench_placement.py [--quick]

For each graph and each cost model (in-process `local`, IPFS `pubsub`) it prints:
  - nodes, and free units (alias units neither stored nor pinned: what `place` decides);
  - bytes moved and estimated finish time of `place`, as ratios to the naive placement
    (each op where its largest input lives);
  - finish time as a ratio to the optimum (exhaustive search) where there are at most ten
    free units, else to a lower bound (the longer of the compute-only critical path and the
    total compute spread over all workers), marked "lb";
  - compile time of `place` in ms (median of three).
MLP, two-tower and residual CNN forward + backward passes are traced for real on a local grid
with their layers spread over 3 workers; chains and random DAGs are built directly.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import gridgraph as gg
from gridgraph.schedule.cost import CostModel, Timeline, bytes_moved, finish_time
from gridgraph.schedule.exact import exact_placement, free_units
from gridgraph.schedule.place import naive_placement, place

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "schedule"))
from graphs import WORKERS, chain, far_weight_chain, random_dag, residual_cnn, two_tower  # noqa: E402

MODELS = {"local": CostModel.local(), "pubsub": CostModel.pubsub()}


# --- traced models ---------------------------------------------------------------------------


def traced(build) -> tuple[list, dict]:
    """Trace build(grid) (forward + backward) on a fresh local grid; its pending graph."""
    torch.manual_seed(0)
    with gg.local_grid(3) as grid:
        with gg.trace():
            build(grid)
        return grid.client.graph.nodes(), dict(grid.client.graph.values)


def mlp(grid: gg.Grid, width: int = 256, batch: int = 64) -> None:
    layers = [nn.Linear(width, width) for _ in range(3)] + [nn.Linear(width, 10)]
    for i, layer in enumerate(layers):
        layer.send(grid.workers[i * 3 // len(layers)])  # parameters over the 3 workers
    x = gg.send(torch.randn(batch, width), grid.workers[0])
    y = gg.send(torch.randint(0, 10, (batch,)), grid.workers[0])
    h = x
    for layer in layers[:-1]:
        h = torch.relu(layer(h))
    F.cross_entropy(layers[-1](h), y).backward()


def towers(grid: gg.Grid, width: int = 512, batch: int = 128) -> None:
    """Two towers over one input on w1 and w2; the head on w0 joins them."""
    w0, w1, w2 = grid.workers
    a = nn.Sequential(*[m for _ in range(3) for m in (nn.Linear(width, width), nn.ReLU())])
    b = nn.Sequential(*[m for _ in range(3) for m in (nn.Linear(width, width), nn.ReLU())])
    head = nn.Linear(2 * width, 1)
    a.send(w1)
    b.send(w2)
    head.send(w0)
    x = gg.send(torch.randn(batch, width), w0)
    head(torch.cat([a(x), b(x)], 1)).pow(2).mean().backward()


def resnet(grid: gg.Grid, channels: int = 32, blocks: int = 3) -> None:
    """conv-relu-conv + skip per block; block i's parameters on worker i."""
    convs = []
    for i in range(blocks):
        pair = [nn.Conv2d(channels, channels, 3, padding=1) for _ in range(2)]
        for c in pair:
            c.send(grid.workers[i % 3])
        convs.append(pair)
    stem = nn.Conv2d(3, channels, 3, padding=1)
    stem.send(grid.workers[0])
    # requires_grad: else conv backward skips grad_input, which records as data-dependent
    x = gg.send(torch.randn(16, 3, 32, 32, requires_grad=True), grid.workers[0])
    h = torch.relu(stem(x))
    for c1, c2 in convs:
        h = torch.relu(c2(torch.relu(c1(h))) + h)
    h.mean().backward()


# --- measuring ---------------------------------------------------------------------------


def lower_bound(nodes, values, cost: CostModel) -> float:
    """No placement finishes before its compute-only critical path or total work / workers."""
    tl = Timeline(nodes, values, WORKERS, cost)
    ct = [row[0] for row in tl.ct]
    path = [0.0] * len(nodes)
    for i, row in enumerate(tl.ins):
        path[i] = ct[i] + max((path[p] for p, *_ in row if p >= 0), default=0.0)
    return max(max(path, default=0.0), sum(ct) / len(WORKERS))


def measure(name: str, nodes, values, model: str, exact: bool = True) -> dict:
    cost = MODELS[model]
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        p = place(nodes, values, WORKERS, cost)
        times.append(time.perf_counter() - t0)
    naive = naive_placement(nodes, values)
    t, t_naive = finish_time(nodes, values, p, cost), finish_time(nodes, values, naive, cost)
    b, b_naive = bytes_moved(nodes, values, p), bytes_moved(nodes, values, naive)
    free = free_units(nodes, values)
    if exact and free <= 10:
        _, best = exact_placement(nodes, values, WORKERS, cost)
        vs = f"{t / best:.3f}"
    else:
        vs = f"{t / lower_bound(nodes, values, cost):.3f} lb"
    return {
        "graph": name, "model": model, "nodes": len(nodes), "free": free,
        "bytes": f"{b / b_naive:.3f}" if b_naive else ("1.000" if b == 0 else "inf"),
        "time": f"{t / t_naive:.3f}", "opt": vs, "ms": f"{statistics.median(times) * 1e3:.1f}",
        "b": b, "b_naive": b_naive,
    }  # fmt: skip


def small_random(model: str, seeds: int) -> dict:
    """Random 10-node DAGs over many seeds: the worst and mean ratio to the optimum."""
    cost = MODELS[model]
    ratios, ms = [], []
    for seed in range(seeds):
        g = random_dag(10, 100 + seed, d=[64, 256, 512][seed % 3])
        t0 = time.perf_counter()
        p = place(g.nodes, g.values, WORKERS, cost)
        ms.append((time.perf_counter() - t0) * 1e3)
        _, best = exact_placement(g.nodes, g.values, WORKERS, cost)
        ratios.append(finish_time(g.nodes, g.values, p, cost) / best)
    return {
        "graph": f"random 10 x{seeds} seeds", "model": model, "nodes": 10, "free": "<=10",
        "bytes": "", "time": "", "ms": f"{statistics.median(ms):.1f}",
        "opt": f"max {max(ratios):.3f} mean {statistics.mean(ratios):.4f}",
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="skip the 10,000-node graph")
    args = ap.parse_args()
    started = time.perf_counter()
    suite = [
        ("MLP fwd+bwd (traced)", *traced(mlp)),
        ("two-tower fwd+bwd (traced)", *traced(towers)),
        ("residual CNN fwd+bwd (traced)", *traced(resnet)),
    ]
    small = [
        ("chain, data on one worker", chain([64, 128, 32, 256, 8], workers=["w1"])),
        ("chain, 1 KB weight far", far_weight_chain(small_weight=True)),
        ("chain, 4 MB weight far", far_weight_chain(small_weight=False)),
        ("chain, weights spread", chain([64, 128, 32, 256, 8])),
        ("two-tower, depth 2", two_tower(d=256, depth=2)),
        ("residual CNN, 2 blocks", residual_cnn(channels=32, blocks=2)),
    ]
    suite += [(name, g.nodes, g.values) for name, g in small]
    for n in (10, 100, 1000) + (() if args.quick else (10_000,)):
        g = random_dag(n, seed=n)
        suite.append((f"random DAG {n}", g.nodes, g.values))
    rows = []
    for name, nodes, values in suite:
        for model in MODELS:
            rows.append(measure(name, nodes, values, model))
    for model in MODELS:
        rows.append(small_random(model, seeds=20))

    cols = [("graph", 30), ("model", 7), ("nodes", 6), ("free", 5), ("bytes", 7),
            ("time", 7), ("opt", 22), ("ms", 7)]  # fmt: skip
    print("ratios: bytes and time of place / naive placement; opt: time of place / optimum")
    print("(exhaustive search), or / lower bound where marked lb; ms: compile time of place")
    print("  ".join(f"{c:>{w}}" if c != "graph" else f"{c:<{w}}" for c, w in cols))
    for r in rows:
        cells = [f"{r[c]!s:<{w}}" if c == "graph" else f"{r[c]!s:>{w}}" for c, w in cols]
        print("  ".join(cells))
    print("\nchains: bytes moved by place, by naive, and the fewest any placement moves")
    graphs = dict(small)
    for r in rows:
        if r["graph"].startswith("chain"):
            g = graphs[r["graph"]]
            fewest, _ = exact_placement(g.nodes, g.values, WORKERS, MODELS[r["model"]], "bytes")
            least = bytes_moved(g.nodes, g.values, fewest)
            print(
                f"  {r['graph']:<26} {r['model']:>7}  place {r['b']:>6}  naive {r['b_naive']:>6}"
                f"  fewest {least:>6}" + ("" if r["b"] == least else "  (faster: see below)")
            )
    print(
        "  (weights stored elsewhere can be sent at time 0, in parallel with the compute, so\n"
        "  the fastest placement of a chain over spread weights may move more than the fewest)"
    )
    print(f"benchmark wall time {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
