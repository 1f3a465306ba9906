"""A small model's training step: plain torch, `gg.trace()` and `gg.compile`, side by side.

Run: python bench/bench_compile.py [--steps 200] [--profile]

The issue's small model: a 13 -> 64 -> 1 MLP, batch 32, SGD with momentum, on
`gg.local_grid(2)` (the model on w0, the data on w1). Each step reads its loss (`.item()`),
as a training loop that prints it does. Prints per step: wall time of each of the three (the
median of interleaved rounds, so machine noise hits all three alike), their ratios to plain
torch, and messages per step of the traced and the compiled step; and `unsynced`: the
compiled step called `--steps` times reading nothing, then `grid.sync()` (all of it timed).

It also prints plain torch timed before the grid starts, alone in the process. The
interleaved plain step is slower: the workers' threads each hold an OpenMP team, and once a
process has more OpenMP threads than cores, libgomp lets idle helpers sleep at once, so each
small matrix product on the user's thread pays to wake its helper (see bench_threads.py).
That slowdown is a cost gridgraph puts on the user's own torch code; the ratios against the
lone plain step count it. `--profile` prints where
the client's time goes in a replayed step (cProfile).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

import gridgraph as gg


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(13, 64), nn.ReLU(), nn.Linear(64, 1))


def train_step(model: nn.Module, opt: torch.optim.Optimizer, x, y):
    opt.zero_grad()
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss


def timed(run, steps: int) -> float:
    """Seconds per call of `run` over `steps` calls."""
    t = time.perf_counter()
    for _ in range(steps):
        run()
    return (time.perf_counter() - t) / steps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    X, Y = torch.randn(32, 13), torch.randn(32, 1)

    plain = make_model()
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.01, momentum=0.9)

    def plain_step() -> float:
        return train_step(plain, plain_opt, X, Y).item()

    for _ in range(5):
        plain_step()
    alone = statistics.median(timed(plain_step, args.steps) for _ in range(args.rounds))

    with gg.local_grid(2) as grid:
        w0, w1 = grid.workers
        traced, compiled = make_model().send(w0), make_model().send(w0)
        traced_opt = torch.optim.SGD(traced.parameters(), lr=0.01, momentum=0.9)
        compiled_opt = torch.optim.SGD(compiled.parameters(), lr=0.01, momentum=0.9)
        x, y = X.send(w1), Y.send(w1)

        def traced_step() -> float:
            with gg.trace():
                loss = train_step(traced, traced_opt, x, y)
            return loss.item()

        @gg.compile
        def step(x, y):
            return train_step(compiled, compiled_opt, x, y)

        def compiled_step() -> float:
            return step(x, y).item()

        def unsynced_steps(steps: int) -> float:
            """Seconds per step of `steps` compiled steps that read nothing, then a sync."""
            t = time.perf_counter()
            for _ in range(steps):
                step(x, y)
            grid.sync()
            return (time.perf_counter() - t) / steps

        for _ in range(5):  # warm-up: caches filled, the compiled step replays
            plain_step(), traced_step(), compiled_step()
        assert step.replays > 0, step.not_replayable

        times: dict[str, list[float]] = {"plain": [], "traced": [], "compiled": [], "unsynced": []}
        for _ in range(args.rounds):
            times["plain"].append(timed(plain_step, args.steps))
            times["traced"].append(timed(traced_step, args.steps))
            times["compiled"].append(timed(compiled_step, args.steps))
            times["unsynced"].append(unsynced_steps(args.steps))
        med = {k: statistics.median(v) for k, v in times.items()}

        messages = {}
        for name, run in (("traced", traced_step), ("compiled", compiled_step)):
            grid.client.compute_all()  # nothing of the other one pending
            grid.reset_stats()
            for _ in range(10):
                run()
            grid.client.compute_all()  # a traced step's optimizer update runs with the next
            messages[name] = grid.stats()["messages"] / 10

        print("13 -> 64 -> 1 MLP, batch 32, SGD(momentum), 2 local workers, loss read each step")
        for name in ("plain", "traced", "compiled", "unsynced"):
            ratio = med[name] / med["plain"]
            msgs = f"   messages/step {messages[name]:.1f}" if name in messages else ""
            print(f"  {name:9s} {med[name] * 1e6:9.1f} us/step   {ratio:6.2f}x plain torch{msgs}")
        print(f"  compiled vs traced: {med['compiled'] / med['traced']:.2f}x")
        print(f"plain torch alone, timed before the grid started: {alone * 1e6:.1f} us/step")
        for name in ("plain", "traced", "compiled", "unsynced"):
            print(f"  {name:9s} {med[name] / alone:6.2f}x plain torch alone")

        if args.profile:
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(args.steps):
                compiled_step()
            profiler.disable()
            pstats.Stats(profiler).sort_stats("cumulative").print_stats(25)


if __name__ == "__main__":
    main()
