"""The examples run as their docs say, on both transports."""

from __future__ import annotations

import torch

from examples import multinode_demo


def test_the_multinode_demo_fits_as_torch_does_and_no_shard_leaves_its_worker(grid):
    xs, ys, _ = multinode_demo.shards(len(grid.workers))
    remote_x = [x.send(w) for x, w in zip(xs, grid.workers)]
    remote_y = [y.send(w) for y, w in zip(ys, grid.workers)]
    w = torch.zeros(8, 1).send(grid.workers[0])
    steps = 8
    grid.reset_stats()
    fitted = multinode_demo.fit(remote_x, remote_y, w, steps, lr=0.1, homes=grid.workers)
    want = multinode_demo.fit(xs, ys, torch.zeros(8, 1), steps, lr=0.1)
    torch.testing.assert_close(fitted.get(), want)
    moved = grid.stats()["bytes"] / steps
    print(f"bytes per step: {moved:.0f}")
    assert moved < xs[0].nbytes / 4  # weights and gradients travel, never a shard's rows
