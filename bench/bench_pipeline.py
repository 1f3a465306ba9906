"""Compiled steps nobody waits for, against the synchronous step: what asynchronous dispatch
buys (exec/client/inflight.py).

Run: python bench/bench_pipeline.py [--kubo] [--steps 100] [--rounds 5]

The model: a 64-wide MLP (64 -> 64 -> 64 -> 1), batch 32, SGD with momentum, its three
layers spread over three workers (layer i on worker i), the batch on w0. `gg.compile`d.
- synchronous: each step reads its loss (`step(x, y).item()`): the step's full latency.
- unsynced: `--steps` steps with no sync, then `grid.sync()`: the time per step, all of it
  counted. The workers, not the client, set the pace.
Prints ms per step of each (median of `--rounds` rounds, interleaved) and their ratio, and
checks that both trained the same (bit-identical parameters after the same number of
steps). `--kubo`: three loopback Kubo nodes with a worker each (a temporary swarm, stopped at
the end), the client on node 0; else `gg.local_grid(3)`.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import gridgraph as gg


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                         nn.Linear(64, 1))  # fmt: skip


def spread(model: nn.Sequential, workers: list) -> nn.Sequential:
    for layer, worker in zip([model[0], model[2], model[4]], workers):
        layer.send(worker)
    return model


def compiled_step(model: nn.Module):
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    @gg.compile
    def step(x, y):
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kubo", action="store_true", help="three loopback Kubo nodes")
    parser.add_argument("--steps", type=int, default=100, help="steps per round")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    X, Y = torch.randn(32, 64), torch.randn(32, 1)
    with ExitStack() as stack:
        if args.kubo:
            from gridgraph.exec.ipfs.swarm import local_swarm

            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="gg-bench-"))
            apis = stack.enter_context(local_swarm(3, Path(tmp), log_level="WARNING"))
            grid = stack.enter_context(
                gg.connect(ipfs=apis[0], min_workers=3, workers=["w0", "w1", "w2"])
            )
            where = "3 Kubo nodes, a worker each"
        else:
            grid = stack.enter_context(gg.local_grid(3))
            where = "gg.local_grid(3)"
        workers = grid.workers
        x, y = X.send(workers[0]), Y.send(workers[0])
        synced_model, unsynced_model = spread(make_model(), workers), spread(make_model(), workers)
        synced, unsynced = compiled_step(synced_model), compiled_step(unsynced_model)
        for _ in range(5):  # warm-up: plans cached, both steps replay
            synced(x, y).item()
            unsynced(x, y).item()
        assert synced.replays > 0 and unsynced.replays > 0, synced.not_replayable

        times: dict[str, list[float]] = {"synchronous": [], "unsynced": []}
        for _ in range(args.rounds):
            start = time.perf_counter()
            for _ in range(args.steps):
                synced(x, y).item()
            times["synchronous"].append((time.perf_counter() - start) / args.steps)
            start = time.perf_counter()
            for _ in range(args.steps):
                unsynced(x, y)
            grid.sync()
            times["unsynced"].append((time.perf_counter() - start) / args.steps)
        same = all(
            torch.equal(a.get(), b.get())
            for a, b in zip(synced_model.parameters(), unsynced_model.parameters())
        )
        med = {k: 1000 * statistics.median(v) for k, v in times.items()}
    print(f"64-wide MLP, batch 32, SGD(momentum), layers on 3 workers ({where}), compiled")
    print(f"  synchronous step (.item() each)   {med['synchronous']:8.2f} ms/step")
    print(f"  {args.steps} steps, no sync, then sync   {med['unsynced']:8.2f} ms/step   "
          f"{med['unsynced'] / med['synchronous']:.2f}x synchronous")  # fmt: skip
    print(f"  same parameters, bit for bit: {same}")


if __name__ == "__main__":
    main()
