"""Plan cache: cost of a hit on a ~500-op training step, and messages per step against
eager per-op execution, measured side by side in one run.

Run: python bench/bench_plan_cache.py
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn

import gridgraph as gg
from gridgraph.schedule.cache import signature
from gridgraph.schedule.plan import run_params, split


def model_and_step(grid: gg.Grid, depth: int):
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(32, 32), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(32, 4))
    linears = [m for m in model if isinstance(m, nn.Linear)]
    for i, layer in enumerate(linears):
        layer.send(grid.workers[i * len(grid.workers) // len(linears)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = gg.send(torch.randn(16, 32), grid.workers[0])
    y = gg.send(torch.randint(0, 4, (16,)), grid.workers[-1])

    def record():
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss

    return record


def main() -> None:
    with gg.local_grid(3) as grid:
        record = model_and_step(grid, depth=15)
        client = grid.client
        for _ in range(4):  # optimizer state exists, the plan is cached
            with gg.trace():
                loss = record()
            client.compute_all()
        with gg.trace():
            loss = record()
        needed = client.graph.needed_for([loss._vid])
        needed |= set(client.graph.pending)
        nodes = [client.graph.pending[n] for n in sorted(needed)]
        client.release_dead()
        keep = client._keep(needed, nodes)
        values = client.graph.values
        reps = 50
        t = time.perf_counter()
        for _ in range(reps):
            key, slots = signature(nodes, values, keep, [], set())
            plan = client.plans.get(key)
            params = run_params(nodes)
        hit = (time.perf_counter() - t) / reps
        assert plan is not None, "the step should be in the plan cache"
        t = time.perf_counter()
        for _ in range(5):
            placement = client.place(nodes, values, client.workers)
            split(nodes, placement, values, keep, [], set(), slots)
        compile_ = (time.perf_counter() - t) / 5
        client.compute_all()
        print(
            f"step of {len(nodes)} recorded ops: plan-cache hit {hit * 1e3:.3f} ms "
            f"(signature + lookup + parameters), compile on a miss {compile_ * 1e3:.1f} ms, "
            f"ratio {compile_ / hit:.0f}x; {len(params)} parameters per run"
        )

        steps = 5
        grid.reset_stats()
        for _ in range(steps):
            with gg.trace():
                record()
            client.compute_all()
        traced = grid.stats()["messages"] / steps
        grid.reset_stats()
        for _ in range(steps):
            record()  # outside trace(): one round trip per op
        eager = grid.stats()["messages"] / steps
        print(
            f"messages per training step: traced with plan cache {traced:.0f}, "
            f"eager per-op {eager:.0f}, ratio {eager / traced:.0f}x fewer"
        )


if __name__ == "__main__":
    main()
