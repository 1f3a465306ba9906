"""`Grid.send_module`: a tensor that modules share (tied weights) stays one tensor, and a lazy
module's parameters follow it to its worker once shaped."""

from __future__ import annotations

import copy
import gc

import torch
import torch.nn.functional as F
from torch import nn

import gridgraph as gg


class Tied(nn.Module):
    """An embedding and an output head sharing one weight, as language models do."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(tokens))


def sgd_steps(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(3):
        with gg.trace():
            opt.zero_grad()
            loss = F.cross_entropy(model(tokens), targets)
            loss.backward()
            opt.step()
        losses.append(loss.item())
    return losses


def test_a_module_with_tied_weights_sends_them_once_and_trains_as_in_torch(local_grid):
    torch.manual_seed(0)
    model = Tied()
    remote = copy.deepcopy(model)
    tokens, targets = torch.randint(0, 10, (6,)), torch.randint(0, 10, (6,))
    want = sgd_steps(model, tokens, targets)

    w0 = local_grid.workers[0]
    before = local_grid.stats()["workers"]["w0"]["objects"]
    remote.send(w0)
    assert remote.head.weight is remote.embed.weight
    assert local_grid.stats()["workers"]["w0"]["objects"] == before + 1
    got = sgd_steps(remote, tokens.send(w0), targets.send(w0))

    assert got == want  # both uses' gradients reach the one weight
    torch.testing.assert_close(remote.embed.weight.get(), model.embed.weight.detach())


def test_a_tied_weight_sent_with_one_module_is_kept_by_the_next(local_grid):
    remote = Tied()
    w0, w1 = local_grid.workers[:2]
    remote.embed.send(w0)
    remote.head.send(w1)  # the same weight: it stays the one pointer, on w0
    assert remote.head.weight is remote.embed.weight
    assert remote.head.weight.location == "w0"
    assert local_grid.stats()["workers"]["w1"]["objects"] == 0


def test_the_grid_does_not_keep_a_sent_module_s_tensors_alive(local_grid):
    model = nn.Linear(3, 2)
    weight = model.weight  # the user still holds the local parameter
    w0 = local_grid.workers[0]
    model.send(w0)
    assert local_grid.stats()["workers"]["w0"]["objects"] == 2
    del model
    gc.collect()
    assert local_grid.stats()["workers"]["w0"]["objects"] == 0
    del weight


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
