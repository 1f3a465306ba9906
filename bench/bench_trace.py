"""Recording overhead, messages per step and wall time of a traced MLP training step.

Run: python bench/bench_trace.py [--hidden 1024] [--steps 10]

Prints, for an MLP whose layers are spread over 3 local workers:
  - recording overhead per recorded op (us) and its ratio to plain torch's own cost per op
    for the same step, measured on a small model so that recording, not arithmetic,
    dominates; next to it, the floor of any recorder on torch's Python dispatch: the same
    step on tensor subclasses that record nothing (`dispatch_floor`);
  - messages per training step;
  - wall time per step next to the same step in plain torch, as a ratio, in one run.

Plain torch is timed twice: interleaved with gridgraph, and alone, before the grid starts.
The workers' threads can slow the user's own torch code beside them (bench_compile.py says
how), so the ratios against the lone plain step count that too; both are printed.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

import gridgraph as gg


def mlp(width: int, depth: int = 3) -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def step(model, opt, x, y):
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss


def spread(model: nn.Module, grid: gg.Grid) -> None:
    linears = [m for m in model if isinstance(m, nn.Linear)]
    for i, layer in enumerate(linears):
        layer.send(grid.workers[i * len(grid.workers) // len(linears)])


def plain_small_step(rounds: int = 7) -> float:
    """Microseconds per step of `recording_overhead`'s tiny MLP in plain torch: the median
    over rounds of 40 steps."""
    model = mlp(8)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    X, Y = torch.randn(4, 8), torch.randint(0, 10, (4,))
    for _ in range(5):
        step(model, opt, X, Y)
    per_round = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(40):
            step(model, opt, X, Y)
        per_round.append((time.perf_counter() - t) / 40 * 1e6)
    return statistics.median(per_round)


def plain_steps(model, opt, X, Y, steps: int) -> float:
    """Seconds per plain torch step of `model`, reading the loss each step."""
    t = time.perf_counter()
    for _ in range(steps):
        step(model, opt, X, Y).item()
    return (time.perf_counter() - t) / steps


class _Shaped(torch.Tensor):
    """A tensor with a shape and no data, every op on which returns new ones, shaped from a
    cache of the op's meta outputs: the least any recorder built on torch's Python dispatch
    does per op (no graph, no ids, no pointers). See `dispatch_floor`."""

    outputs: dict = {}  # (op, shapes and values of its arguments) -> its outputs on meta

    @staticmethod
    def __new__(cls, like: torch.Tensor) -> _Shaped:
        return torch.Tensor._make_wrapper_subclass(
            cls, like.shape, strides=like.stride(), dtype=like.dtype, device="cpu"
        )

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        key = (func, *map(_shape_key, args))
        if kwargs:
            key += tuple(map(_shape_key, kwargs.items()))
        out = cls.outputs.get(key)
        if out is None:
            out = cls.outputs[key] = func(*map(_on_meta, args), **(kwargs or {}))
        if isinstance(out, torch.Tensor):
            return _Shaped(out)
        if isinstance(out, tuple | list):
            return type(out)(_Shaped(o) if isinstance(o, torch.Tensor) else o for o in out)
        return out


def _shape_key(a: object) -> object:
    if isinstance(a, torch.Tensor):
        return a.shape  # (one dtype per op in this step)
    if isinstance(a, tuple | list):
        return tuple(map(_shape_key, a))
    return a


def _on_meta(a: object) -> object:
    if isinstance(a, torch.Tensor):
        return torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="meta")
    if isinstance(a, tuple | list):
        return type(a)(map(_on_meta, a))
    return a


def dispatch_floor(rounds: int = 7) -> float:
    """How many times plain torch's time a step of `recording_overhead`'s tiny MLP takes when
    its parameters and data are `_Shaped`: what torch's Python dispatch costs a recorder
    before it records anything. Rounds alternate with plain steps; the median ratio."""
    plain_model, model = mlp(8), mlp(8)
    for layer in model:
        if isinstance(layer, nn.Linear):
            layer.weight = nn.Parameter(_Shaped(layer.weight))
            layer.bias = nn.Parameter(_Shaped(layer.bias))
    plain_opt = torch.optim.SGD(plain_model.parameters(), lr=0.01)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    X, Y = torch.randn(4, 8), torch.randint(0, 10, (4,))
    x, y = _Shaped(X), _Shaped(Y)
    ratios = []
    for _ in range(rounds):
        times = []
        for args in ((plain_model, plain_opt, X, Y), (model, opt, x, y)):
            for _ in range(5):
                step(*args)
            t = time.perf_counter()
            for _ in range(40):
                step(*args)
            times.append(time.perf_counter() - t)
        ratios.append(times[1] / times[0])
    return statistics.median(ratios)


def recording_overhead(grid: gg.Grid, rounds: int = 7) -> tuple[float, float, int]:
    """Microseconds per recorded op of a tiny MLP's step in `trace()`, the same step in plain
    torch per op, and ops per step. The model is small so that recording, not arithmetic,
    dominates. Rounds alternate a block of traced steps with a block of plain ones (plain
    torch in a loop of its own, as a training loop runs it), so both see the same machine
    load; each figure is the median over rounds of the block's median or mean."""
    model = mlp(8)
    local = copy.deepcopy(model)
    spread(model, grid)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    opt_l = torch.optim.SGD(local.parameters(), lr=0.01)
    X, Y = torch.randn(4, 8), torch.randint(0, 10, (4,))
    x, y = gg.send(X, grid.workers[0]), gg.send(Y, grid.workers[2])
    for _ in range(3):  # warm-up: the recipe cache is filled as in any training loop
        with gg.trace():
            step(model, opt, x, y).item()
    traced, plain, ops = [], [], 0
    for _ in range(rounds):
        per_step = []
        for _ in range(8):
            graph = grid.client.graph
            before = len(graph)
            t = time.perf_counter()
            with gg.trace():
                loss = step(model, opt, x, y)
            dt = time.perf_counter() - t
            ops = len(graph) - before
            loss.item()
            per_step.append(dt / ops * 1e6)
        traced.append(statistics.median(per_step))
        for _ in range(5):
            step(local, opt_l, X, Y)
        t = time.perf_counter()
        for _ in range(40):
            step(local, opt_l, X, Y)
        plain.append((time.perf_counter() - t) / 40 / ops * 1e6)
    return statistics.median(traced), statistics.median(plain), ops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()

    torch.manual_seed(0)
    local = mlp(args.hidden)
    remote = copy.deepcopy(local)
    X = torch.randn(args.batch, args.hidden)
    Y = torch.randint(0, 10, (args.batch,))
    opt_l = torch.optim.SGD(local.parameters(), lr=0.01)
    # plain torch alone, before the grid starts
    small_alone = plain_small_step()
    floor = dispatch_floor()
    plain_steps(local, opt_l, X, Y, 2)  # warm-up
    wide_alone = plain_steps(local, opt_l, X, Y, args.steps)

    with gg.local_grid(3) as grid:
        us_per_op, plain, ops = recording_overhead(grid)
        print(
            f"recording overhead: {us_per_op:.1f} us per recorded op, median over steps "
            f"({ops} ops per step of a small MLP; the same step in plain torch costs "
            f"{plain:.1f} us per op, so gridgraph adds {us_per_op - plain:.1f} us): "
            f"ratio {us_per_op / plain:.2f}x plain torch (target <= 2x)"
        )
        alone = small_alone / ops
        print(
            f"  plain torch alone, before the grid started: {alone:.1f} us per op; "
            f"recording {us_per_op / alone:.2f}x that"
        )
        print(
            f"  floor: the same step on tensor subclasses whose __torch_dispatch__ records "
            f"nothing (outputs shaped from a cache) takes {floor:.2f}x plain torch"
        )

        spread(remote, grid)
        x, y = gg.send(X, grid.workers[0]), gg.send(Y, grid.workers[2])
        opt_r = torch.optim.SGD(remote.parameters(), lr=0.01)

        def remote_step():
            with gg.trace():
                loss = step(remote, opt_r, x, y)
            return loss.item()

        for _ in range(2):  # warm-up both
            step(local, opt_l, X, Y).item()
            remote_step()
        grid.reset_stats()
        t_local = t_remote = 0.0
        for _ in range(args.steps):  # interleaved, so both see the same machine load
            t = time.perf_counter()
            step(local, opt_l, X, Y).item()
            t_local += time.perf_counter() - t
            t = time.perf_counter()
            remote_step()
            t_remote += time.perf_counter() - t
        stats = grid.stats()
        print(
            f"messages per step: {stats['messages'] / args.steps:.1f} "
            f"({stats['bytes'] / args.steps / 1e6:.2f} MB per step)"
        )
        print(
            f"wall time per step, hidden={args.hidden} batch={args.batch}: "
            f"plain torch {t_local / args.steps * 1e3:.1f} ms, "
            f"gridgraph (3 local workers) {t_remote / args.steps * 1e3:.1f} ms, "
            f"ratio {t_remote / t_local:.2f}x"
        )
        print(
            f"  plain torch alone, before the grid started: {wide_alone * 1e3:.1f} ms; "
            f"gridgraph {t_remote / args.steps / wide_alone:.2f}x that"
        )


if __name__ == "__main__":
    main()
