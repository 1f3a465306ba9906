"""The multi-node demo: data on several IPFS nodes, a computation across them, results back.

Each worker holds one shard of a regression data set, as if three sites each kept their own
data. A linear model is fitted by gradient descent: every step, each shard's gradient is
computed on the worker that holds the shard (`gg.on`: only the 8 weights travel there), the
gradients meet on w0, which updates the weights. The raw data never leaves its node. The step
is compiled (`gg.compile`): recorded twice, then replayed without re-recording. The result is
checked against the same arithmetic in local torch.

    python examples/multinode_demo.py                     # own 3-node swarm + workers
    python examples/multinode_demo.py --ipfs /ip4/127.0.0.1/tcp/5001   # running workers

Without --ipfs it starts three loopback Kubo nodes and one worker per node (the helpers
behind `gridgraph ipfs up` and `gridgraph worker`) in a temporary directory, and stops them
all at the end. Its last line says where the time went: starting the swarm and workers,
connecting, sending the shards, the first step (recorded), a steady step (replayed) and
teardown.
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import time
from pathlib import Path

import torch

import gridgraph as gg
from gridgraph.exec.ipfs.swarm import local_swarm


def shards(n: int, rows: int = 2000, features: int = 8) -> tuple[list, list, torch.Tensor]:
    torch.manual_seed(0)
    w_true = torch.randn(features, 1)
    xs = [torch.randn(rows, features) for _ in range(n)]
    ys = [x @ w_true + 0.01 * torch.randn(rows, 1) for x in xs]
    return xs, ys, w_true


def make_step(xs: list, ys: list, lr: float, homes: list | None = None):
    """One step of gradient descent on the mean squared error over all shards, `w -> new w`.

    With `homes` (the worker holding each shard), each shard's gradient is computed there
    (`gg.on`), so its rows never travel, and the step is compiled: recorded twice, then
    replayed as one batch per call. Without, it is plain torch on local tensors."""
    total = sum(x.shape[0] for x in xs)

    def step(w):
        grads = []
        for i, (x, y) in enumerate(zip(xs, ys)):
            with gg.on(homes[i]) if homes else contextlib.nullcontext():
                grads.append(x.T @ (x @ w - y))
        g = grads[0]
        for other in grads[1:]:
            g = g + other
        return w - (2 * lr / total) * g

    return gg.compile(step) if homes else step


def fit(xs: list, ys: list, w, steps: int, lr: float, homes=None, report=None, times=None):
    """`steps` gradient steps; the same code runs on pointers (with `homes`) and on local
    tensors. `times`: a list to append the time (perf_counter) at the end of each step."""
    step = make_step(xs, ys, lr, homes)
    total = sum(x.shape[0] for x in xs)
    for i in range(steps):
        w = step(w)  # (a compiled step runs at the call)
        if times is not None:
            times.append(time.perf_counter())
        if report is not None and (i % 10 == 0 or i == steps - 1):
            with gg.trace():
                loss = sum(((x @ w - y) ** 2).sum() for x, y in zip(xs, ys)) / total
            report(i, loss.item())
    return w


def demo(grid: gg.Grid, steps: int) -> dict[str, float]:
    """Fit on the grid, check against local torch; the seconds spent sending, on the first
    step and on a steady step (the median of the rest)."""
    workers = grid.workers
    print(f"grid: {grid}")
    xs, ys, w_true = shards(len(workers))
    start = time.perf_counter()
    remote_x = [x.send(w) for x, w in zip(xs, workers)]
    remote_y = [y.send(w) for y, w in zip(ys, workers)]
    w = torch.zeros(8, 1).send(workers[0])
    sent = time.perf_counter() - start
    print(
        f"sent {len(workers)} shards of {xs[0].shape[0]} rows in {sent:.2f} s: "
        + ", ".join(f"x{i} on {p.location}" for i, p in enumerate(remote_x))
    )

    grid.reset_stats()
    start = time.perf_counter()
    times = [start]
    w = fit(
        remote_x,
        remote_y,
        w,
        steps,
        lr=0.1,
        homes=workers,
        report=lambda s, loss: print(f"  step {s:3d}  loss {loss:.6f}"),
        times=times,
    )
    fitted = w.get()
    took = time.perf_counter() - start
    stats = grid.stats()

    expected = fit(xs, ys, torch.zeros(8, 1), steps, lr=0.1)
    print(
        f"{steps} steps in {took:.2f} s ({1000 * took / steps:.1f} ms/step); weights on "
        f"{w.location}; {stats['messages']} messages, {stats['bytes'] / 1e6:.2f} MB"
    )
    print("per worker:", {n: s["ops_run"] for n, s in stats["workers"].items()}, "ops")
    print(
        f"max |w - w_true| = {(fitted - w_true).abs().max():.4f}; "
        f"matches local torch: {torch.allclose(fitted, expected, atol=1e-5)}"
    )
    if not torch.allclose(fitted, expected, atol=1e-5):
        raise SystemExit("the grid's result differs from local torch")
    steady = sorted(b - a for a, b in zip(times[1:], times[2:]))
    return {
        "send": sent,
        "first step": times[1] - times[0],
        "steady step": steady[len(steady) // 2] if steady else 0.0,
        "training": took,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ipfs", help="API multiaddr of a Kubo node with workers around it")
    parser.add_argument("--workers", type=int, default=3, help="workers to wait for")
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args(argv)
    clock = {"start": time.perf_counter()}
    with contextlib.ExitStack() as stack:
        ipfs = args.ipfs
        if ipfs is None:
            root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="gg-swarm-")))
            print(f"starting {args.workers} Kubo nodes and workers under {root} ...")
            ipfs = stack.enter_context(local_swarm(args.workers, root, log_level="WARNING"))[0]
        clock["swarm"] = time.perf_counter()
        grid = stack.enter_context(gg.connect(ipfs=ipfs, min_workers=args.workers))
        clock["connected"] = time.perf_counter()
        spent = demo(grid, args.steps)
        clock["trained"] = time.perf_counter()
    clock["stopped"] = time.perf_counter()
    print("done; everything started here is stopped")
    swarm = clock["swarm"] - clock["start"]
    connect = clock["connected"] - clock["swarm"]
    teardown = clock["stopped"] - clock["trained"]
    outside = clock["stopped"] - clock["start"] - spent["training"]
    print(
        f"time: swarm and workers {swarm:.1f} s, connect {connect:.1f} s, sending "
        f"{spent['send']:.1f} s, first step {spent['first step']:.2f} s, steady step "
        f"{1000 * spent['steady step']:.0f} ms, teardown {teardown:.1f} s; "
        f"outside training {outside:.1f} s of {clock['stopped'] - clock['start']:.1f} s"
    )


if __name__ == "__main__":
    main()
