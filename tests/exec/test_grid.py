"""Sending modules: a lazy module's parameters follow it to its worker once shaped."""

from __future__ import annotations

import copy

import torch

import gridgraph as gg


def test_a_lazy_module_sent_before_its_first_call_trains_on_its_worker(local_grid):
    torch.manual_seed(0)
    local = torch.nn.LazyConv2d(4, 3)
    remote = copy.deepcopy(local)
    x = torch.randn(2, 3, 8, 8)
    gg.send(remote, local_grid.workers[0])  # nothing to send yet: shaped by the first call
    torch.manual_seed(1)
    want = local(x)
    want.sum().backward()
    torch.manual_seed(1)  # the first call initialises the parameters from torch's generator
    got = remote(gg.send(x, local_grid.workers[1]))
    got.sum().backward()
    assert type(remote) is torch.nn.Conv2d
    assert all(isinstance(p, gg.RemoteTensor) for p in remote.parameters())
    assert {p.location for p in remote.parameters()} == {"w0"}
    torch.testing.assert_close(got.get(), want.detach())
    for p, w in zip(remote.parameters(), local.parameters()):
        torch.testing.assert_close(p.grad.get(), w.grad)
