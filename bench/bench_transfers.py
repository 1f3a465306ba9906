"""Coalesced transfers on training steps: bytes, messages and time of placement (a benchmark).

Run: python bench/bench_transfers.py [--dump FILE] [--baseline FILE]
The exact minimum needs scipy: `pip install -e .[bench]`.

Each training step (forward, backward and an SGD step, traced for real on a local grid of 3
workers with the layers spread over them, as bench_placement.py does) is placed by `place`
under the in-process (`local`) and IPFS (`pubsub`) cost models. For each it prints:
  - nodes, and free units (alias units neither stored nor pinned: what `place` decides);
  - bytes: bytes moved by `place` / the fewest bytes any placement moves (an integer linear
    program over the same alias units, `exact.fewest_bytes`); the target is <= 1.5;
  - msgs: transfer messages per step (the split plan's `send` steps) and transfers (values);
  - time: the estimated finish time under the cost model, in microseconds;
  - lean: the estimated finish time of the fastest placement moving <= 1.5x the fewest bytes
    (exact, by branch and bound: `exact.fastest_within`), as a ratio to `place`'s time. Over
    1, no placement meets both targets (bytes <= 1.5x, no slower) on that graph and model.
`--dump FILE` writes the placements (a worker per node, in recording order) to FILE;
`--baseline FILE` reads such a file, written by an earlier version of gridgraph on the same
graphs, and prints its placements' bytes, messages and finish time under this version's cost
model beside this version's ("old -> new"). Last, the demo MLP trains for a few steps on a
local grid and `grid.stats()` gives the messages of a replayed step (runs, replies and
transfers); with --baseline, the earlier version's count too.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from torch import nn

import gridgraph as gg
from gridgraph.schedule.cost import CostModel, bytes_moved, finish_time
from gridgraph.schedule.place import place

MODELS = {"local": CostModel.local(), "pubsub": CostModel.pubsub()}
WORKERS = ["w0", "w1", "w2"]


# --- training steps ----------------------------------------------------------------------------


def demo_mlp() -> tuple[nn.Module, torch.Tensor, torch.Tensor, list[int]]:
    """gridgraph/demo.py's model and data; module i's parameters on worker at[i]."""
    X = torch.randn(256, 16)
    Y = (X[:, :4].sum(1) > 0).long()
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                          nn.Linear(64, 2))  # fmt: skip
    return model, X, Y, [0, 0, 1, 1, 2]


def bn_cnn() -> tuple[nn.Module, torch.Tensor, torch.Tensor, list[int]]:
    """conv-BatchNorm-relu twice, pooling, a linear head: a block per worker."""
    X = torch.randn(16, 3, 16, 16)
    Y = torch.randint(0, 10, (16,))
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(32 * 16, 10),
    )  # fmt: skip
    return model, X, Y, [0, 0, 0, 1, 1, 1, 2, 2, 2]


def wide_mlp() -> tuple[nn.Module, torch.Tensor, torch.Tensor, list[int]]:
    """Three 512-wide layers and a head, batch 128."""
    X = torch.randn(128, 512)
    Y = torch.randint(0, 10, (128,))
    layers: list[nn.Module] = []
    for _ in range(3):
        layers += [nn.Linear(512, 512), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(512, 10))
    return model, X, Y, [0, 0, 1, 1, 2, 2, 2]


GRAPHS = {"demo MLP": demo_mlp, "CNN with BatchNorm": bn_cnn, "wide MLP": wide_mlp}


def spread(grid: gg.Grid, build) -> tuple[nn.Module, object, object, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model, X, Y, at = build()
    for module, i in zip(model, at):
        module.send(grid.workers[i])
    x, y = X.send(grid.workers[0]), Y.send(grid.workers[2])
    return model, x, y, torch.optim.SGD(model.parameters(), lr=0.01)


def step(model, x, y, opt) -> torch.Tensor:
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss


def traced_step(build) -> tuple[list, dict]:
    """The pending graph of one training step (the second: the first made the gradients)."""
    with gg.local_grid(3) as grid:
        model, x, y, opt = spread(grid, build)
        with gg.trace():
            step(model, x, y, opt)
        gg.compute(*model.parameters())
        with gg.trace():
            step(model, x, y, opt)
        return grid.client.graph.nodes(), dict(grid.client.graph.values)


def messages_per_step(steps: int = 6) -> int:
    """grid.stats()'s messages of the last of `steps` replayed demo MLP steps."""
    with gg.local_grid(3) as grid:
        model, x, y, opt = spread(grid, demo_mlp)
        for _ in range(steps):
            with gg.trace():
                loss = step(model, x, y, opt)
            gg.compute(loss, *model.parameters())
            grid.reset_stats()
        with gg.trace():
            loss = step(model, x, y, opt)
        gg.compute(loss, *model.parameters())
        return grid.stats()["messages"]


# --- measuring ---------------------------------------------------------------------------------


def measure(nodes, values, placement, cost: CostModel) -> dict:
    from gridgraph.schedule.plan import split

    plan = split(nodes, placement, values, keep=set())
    return {
        "bytes": bytes_moved(nodes, values, placement),
        "messages": plan.messages,
        "transfers": len(plan.transfers),
        "time": finish_time(nodes, values, placement, cost),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dump", help="write the placements to this JSON file")
    ap.add_argument("--baseline", help="compare with placements an earlier version dumped")
    args = ap.parse_args()
    started = time.perf_counter()
    graphs = {name: traced_step(build) for name, build in GRAPHS.items()}
    placements = {
        name: {model: place(nodes, values, WORKERS, cost) for model, cost in MODELS.items()}
        for name, (nodes, values) in graphs.items()
    }
    if args.dump:
        with open(args.dump, "w") as f:
            json.dump(
                {
                    "placements": {
                        name: {m: [p[n.id] for n in graphs[name][0]] for m, p in by_model.items()}
                        for name, by_model in placements.items()
                    },
                    "messages_per_step": messages_per_step(),
                },
                f,
            )
        print(f"placements written to {args.dump}")
        return

    from gridgraph.schedule.exact import fastest_within, fewest_bytes, free_units

    baseline = None
    if args.baseline:
        with open(args.baseline) as f:
            baseline = json.load(f)
    print("bytes: moved by place / fewest any placement moves (ILP); msgs: transfer messages")
    print("(transfers); time: estimated finish time in us under the model" + (
        "; old -> new: the baseline's placement, then this one's, under this cost model"
        if baseline else ""))  # fmt: skip
    print("lean: the fastest placement moving <= 1.5x the fewest bytes, its time / place's")
    for name, (nodes, values) in graphs.items():
        fewest, least = fewest_bytes(nodes, values, WORKERS)
        for model, cost in MODELS.items():
            new = measure(nodes, values, placements[name][model], cost)
            _, lean = fastest_within(nodes, values, WORKERS, cost, 1.5 * least, known=fewest)
            ratio = new["bytes"] / least if least else (1.0 if new["bytes"] == 0 else 0.0)
            line = (
                f"{name:<20} {model:>6}  nodes {len(nodes):4d}  free {free_units(nodes, values):3d}"
                f"  bytes {new['bytes']:>8d} / {least:>8d} = {ratio:5.2f}"
            )
            if baseline is None:
                line += (
                    f"  msgs {new['messages']:3d} ({new['transfers']:3d})"
                    f"  time {new['time'] * 1e6:9.1f}  lean {lean / new['time']:.2f}"
                )
            else:
                order = baseline["placements"][name][model]
                if len(order) != len(nodes):
                    raise SystemExit(f"{name}: the baseline traced another graph")
                old = measure(nodes, values, {n.id: w for n, w in zip(nodes, order)}, cost)
                line += (
                    f"  old bytes {old['bytes'] / least if least else 0:5.2f}"
                    f"  msgs {old['messages']:3d} -> {new['messages']:3d}"
                    f"  time {old['time'] * 1e6:9.1f} -> {new['time'] * 1e6:9.1f}"
                    f" ({new['time'] / old['time']:.3f})  lean {lean / new['time']:.2f}"
                )
            print(line)
    now = messages_per_step()
    before = f"{baseline['messages_per_step']} -> " if baseline else ""
    print(f"demo MLP, replayed SGD step on a local grid: grid.stats() messages {before}{now}")
    print(f"benchmark wall time {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
