"""The plan cache: a repeated training step is compiled once and sent as 'run plan P'."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import gridgraph as gg


def _training(grid):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 2)
    )
    for i, layer in enumerate(m for m in model if isinstance(m, nn.Linear)):
        layer.send(grid.workers[i])
    opt = torch.optim.Adam(model.parameters(), lr=0.01)  # its step size changes every step
    x = gg.send(torch.randn(32, 8), grid.workers[0])
    y = gg.send(torch.randint(0, 2, (32,)), grid.workers[2])

    def step():
        with gg.trace():
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
        return loss.item()

    return step


def test_repeated_step_hits_the_cache_and_sends_no_program(grid):
    step = _training(grid)
    cache = grid.client.plans
    sizes, messages, expected = [], [], []
    for _ in range(10):
        grid.reset_stats()
        step()
        s = grid.stats()
        messages.append(s["messages"])
        plan = grid.client.last_plan
        # one run message per worker plus one reply each, plus the worker-to-worker transfers
        expected.append(2 * len(plan.programs) + plan.messages)
        sizes.append(grid.client.transport.sent.bytes)  # what the client sent: the runs
    # loss.item() runs only the forward pass; the backward pass and the update run with the
    # next step's forward. So run 1 is a forward, run 2 also creates the optimizer's state,
    # and a step or two later every step reuses a plan (the placement may alternate between
    # two, as the previous step's saved tensors land on one worker or another): hits only.
    misses = cache.misses
    assert misses <= 4
    for _ in range(3):
        step()
    assert cache.misses == misses
    assert sizes[9] < sizes[1] / 2  # programs are no longer sent, only ids and parameters
    # one run message per worker plus one reply each, plus the transfers between workers
    runs_and_replies = 2 * 3
    assert messages[9] - runs_and_replies == _transfer_messages(grid)


def _transfer_messages(grid) -> int:
    [plan] = [
        p
        for p in grid.client.plans._plans.values()
        if p.id == max(q.id for q in grid.client.plans._plans.values())
    ]
    return plan.messages


def test_cached_plan_gives_the_same_values_as_a_fresh_one(local_grid):
    a = torch.randn(5, 5)
    p = gg.send(a, local_grid.workers[0])
    outs = []
    for scale in (0.5, 2.0, 3.0):  # floats are parameters: the plan is reused
        with gg.trace():
            q = (p * scale).tanh().sum(0)
        outs.append(q.get())
    assert local_grid.client.plans.hits == 2
    for got, scale in zip(outs, (0.5, 2.0, 3.0)):
        torch.testing.assert_close(got, (a * scale).tanh().sum(0))


def test_different_shapes_do_not_share_a_plan(local_grid):
    w = local_grid.workers[1]
    for n in (3, 4):
        p = gg.send(torch.ones(n), w)
        assert torch.equal((p + 1).get(), torch.full((n,), 2.0))
    # The two adds compile separately; only the fetch-only plan ("return %0") is shared.
    assert local_grid.client.plans.hits == 1 and local_grid.client.plans.misses == 3


def test_worker_that_lost_a_program_gets_it_again(local_grid):
    p = gg.send(torch.ones(3), local_grid.workers[0])
    (p * 2).get()
    for worker in local_grid.local_workers:  # the workers forget every program they keep
        for session in worker.sessions.values():
            session.work.programs.clear()
    assert torch.equal((p * 2).get(), torch.full((3,), 2.0))
