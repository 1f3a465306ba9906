"""A worker's cost per op, and a compute-bound training step, next to plain torch.

Run: python bench/bench_worker.py [--steps 10] [--repeats 3]

Prints, measured side by side in one run:
  (a) the worker-side time per op of running a cached program (`Run.execute`, timed inside
      the worker) for a small MLP training step (13 -> 64 -> 1, batch 32, SGD) and for a
      chain of ops on a tiny tensor, next to plain torch's own time per ATen op for the same
      step in eager mode;
  (b) wall time per step of a 1024-wide MLP (batch 512) spread over 3 local workers, traced
      and with `gg.compile`, next to the same step in plain torch, as ratios, `--repeats`
      times (blocks of `--steps` steps, each block ending when every worker has finished).
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from bench_compile import train_step as small_mlp_step
from bench_trace import mlp as wide_mlp
from bench_trace import spread
from bench_trace import step as wide_step
from torch import nn

import gridgraph as gg
from gridgraph.exec.worker import run as worker_run
from gridgraph.schedule.program import Call


class RunTimer:
    """Times every `Run.execute` on the workers of this process, and counts its ops."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.ops = 0
        self._execute = worker_run.Run.execute

    def __enter__(self) -> RunTimer:
        timer, execute = self, self._execute

        def timed(run, program, unchecked):
            t = time.perf_counter()
            out = execute(run, program, unchecked)
            timer.seconds += time.perf_counter() - t
            timer.ops += sum(type(step) is Call for step in program.steps)
            return out

        worker_run.Run.execute = timed
        return self

    def __exit__(self, *exc: object) -> None:
        worker_run.Run.execute = self._execute


def chain(x):
    for _ in range(25):
        x = x * 1.0001 + 0.5
    return x.sum()


def worker_per_op(fn, make_args, reps: int) -> tuple[float, float, int]:
    """(worker us per op, plain torch us per op, ops per step) for `fn` on one worker."""
    plain_args = make_args(None)
    for _ in range(5):
        fn(*plain_args)
    t = time.perf_counter()
    for _ in range(reps):
        fn(*plain_args).item()
    plain = (time.perf_counter() - t) / reps
    with gg.local_grid(1) as grid:
        remote_args = make_args(grid.workers[0])
        for _ in range(3):  # the first run sends the program; later ones use the cache
            with gg.trace():
                out = fn(*remote_args)
            out.item()
        with RunTimer() as timer:
            for _ in range(reps):
                with gg.trace():
                    out = fn(*remote_args)
                out.item()
    ops = timer.ops // reps
    return timer.seconds / timer.ops * 1e6, plain / ops * 1e6, ops


def small_mlp_args(worker):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(13, 64), nn.ReLU(), nn.Linear(64, 1))
    x, y = torch.randn(32, 13), torch.randn(32, 1)
    if worker is not None:
        model.send(worker)
        x, y = x.send(worker), y.send(worker)
    return model, torch.optim.SGD(model.parameters(), lr=0.01), x, y


def chain_args(worker):
    x = torch.randn(4)
    return (x if worker is None else x.send(worker),)


# --- (b) a compute-bound step ----------------------------------------------------------------


def compute_bound(hidden: int, batch: int, steps: int, repeats: int) -> list[tuple[float, ...]]:
    """(plain torch, traced, compiled) seconds per step on 3 local workers, `repeats` times.

    Each measures `steps` steps of one, then of the next, in turn, so all see the same
    machine load. A gridgraph block ends when every worker has finished (a stats request
    queues behind each worker's runs): `loss.item()` returns once the loss is computed,
    while the workers holding earlier layers still run the backward pass and the optimizer
    step, which would otherwise overlap whatever is timed next.
    """
    with gg.local_grid(3) as grid:
        torch.manual_seed(0)
        local = wide_mlp(hidden)
        traced, compiled = copy.deepcopy(local), copy.deepcopy(local)
        spread(traced, grid)
        spread(compiled, grid)
        X, Y = torch.randn(batch, hidden), torch.randint(0, 10, (batch,))
        x, y = X.send(grid.workers[0]), Y.send(grid.workers[2])
        opt_l = torch.optim.SGD(local.parameters(), lr=0.01)
        opt_t = torch.optim.SGD(traced.parameters(), lr=0.01)
        opt_c = torch.optim.SGD(compiled.parameters(), lr=0.01)
        compiled_step = gg.compile(lambda x, y: wide_step(compiled, opt_c, x, y))

        def plain_steps():
            for _ in range(steps):
                wide_step(local, opt_l, X, Y).item()

        def traced_steps():
            for _ in range(steps):
                with gg.trace():
                    loss = wide_step(traced, opt_t, x, y)
                loss.item()
            grid.stats()  # every worker done

        def compiled_steps():
            for _ in range(steps):
                compiled_step(x, y).item()
            grid.stats()

        out = []
        for i in range(repeats + 1):  # the first round warms up (and records the step)
            times = []
            for run in (plain_steps, traced_steps, compiled_steps):
                t = time.perf_counter()
                run()
                times.append((time.perf_counter() - t) / steps)
            if i:
                out.append(tuple(times))
        assert compiled_step.replays > 0, compiled_step.not_replayable
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    for label, fn, make in (
        ("MLP 13->64->1 batch 32 SGD step", small_mlp_step, small_mlp_args),
        ("tiny-tensor chain (50 ops on 4 floats)", chain, chain_args),
    ):
        worker, plain, ops = worker_per_op(fn, make, args.reps)
        print(
            f"(a) {label}: worker {worker:.1f} us per op, plain torch {plain:.1f} us per op "
            f"({ops} ops per step), ratio {worker / plain:.2f}x"
        )
    print(f"(b) wall time per step, hidden={args.hidden} batch={args.batch}, 3 local workers:")
    for plain, traced, compiled in compute_bound(args.hidden, args.batch, args.steps, args.repeats):
        print(
            f"    plain torch {plain * 1e3:.1f} ms, traced {traced * 1e3:.1f} ms "
            f"({traced / plain:.2f}x), compiled {compiled * 1e3:.1f} ms ({compiled / plain:.2f}x)"
        )


if __name__ == "__main__":
    main()
