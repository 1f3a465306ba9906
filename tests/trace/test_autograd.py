"""Autograd and torch.optim on pointers: the same losses as the same model trained locally."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gridgraph as gg


def mlp() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 3)
    )


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, padding=1, bias=False)  # BN follows: a bias has ~0 grad
        self.bn = nn.BatchNorm2d(4)
        self.conv2 = nn.Conv2d(4, 8, 3, padding=1)
        self.head = nn.Linear(8 * 2 * 2, 3)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn(self.conv1(x))), 2)
        x = F.avg_pool2d(F.relu(self.conv2(x)), 2)
        return self.head(x.flatten(1))


def spread(model: nn.Module, grid) -> None:
    """Send each top-level child to the next worker, round-robin."""
    for i, child in enumerate(model.children()):
        child.send(grid.workers[i % len(grid.workers)])


@pytest.mark.parametrize("opt", ["sgd", "adam"])
@pytest.mark.parametrize(
    "make, shape", [(mlp, (32, 12)), (SmallCNN, (8, 1, 8, 8))], ids=["mlp", "cnn"]
)
def test_training_matches_local(grid, make, shape, opt):
    torch.manual_seed(0)
    local = make()
    remote = copy.deepcopy(local)
    spread(remote, grid)
    X, Y = torch.randn(*shape), torch.randint(0, 3, (shape[0],))
    x, y = gg.send(X, grid.workers[0]), gg.send(Y, grid.workers[-1])

    def optimizer(model):
        if opt == "sgd":
            return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        return torch.optim.Adam(model.parameters(), lr=0.01)

    opt_l, opt_r = optimizer(local), optimizer(remote)
    for _ in range(20):
        opt_l.zero_grad()
        loss_l = F.cross_entropy(local(X), Y)
        loss_l.backward()
        opt_l.step()
        with gg.trace():
            opt_r.zero_grad()
            loss_r = F.cross_entropy(remote(x), y)
            loss_r.backward()
            opt_r.step()
        a, b = loss_l.item(), loss_r.item()
        assert abs(a - b) <= 1e-5 * abs(a), (a, b)
    for p_l, p_r in zip(local.parameters(), remote.parameters()):
        torch.testing.assert_close(p_r.get(), p_l.detach(), rtol=1e-5, atol=1e-6)


def test_grad_is_a_pointer(local_grid):
    w0, w1, _ = local_grid.workers
    a = torch.randn(4, 3, requires_grad=True)
    b = torch.randn(3, requires_grad=True)
    pa, pb = gg.send(a.detach().requires_grad_(), w0), gg.send(b.detach().requires_grad_(), w1)
    assert pa.requires_grad and pa.is_leaf
    with gg.trace():
        loss = (torch.sigmoid(pa @ pb) ** 2).sum()
    loss.backward()
    (torch.sigmoid(a @ b) ** 2).sum().backward()
    assert isinstance(pa.grad, gg.RemoteTensor)
    torch.testing.assert_close(pa.grad.get(), a.grad)
    torch.testing.assert_close(pb.grad.get(), b.grad)
    assert pa.grad.location == "w0" or pa.grad.location == "w1"


def test_model_send_moves_parameters_and_buffers(local_grid):
    model = SmallCNN()
    model.send(local_grid.workers[2])
    for p in model.parameters():
        assert isinstance(p, gg.RemoteTensor) and isinstance(p, nn.Parameter)
        assert p.requires_grad and p.location == "w2"
    assert all(isinstance(b, gg.RemoteTensor) for b in model.buffers())


def test_training_leaves_object_count_flat(local_grid):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    spread(model, local_grid)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = gg.send(torch.randn(16, 8), local_grid.workers[0])
    y = gg.send(torch.randn(16, 1), local_grid.workers[2])

    def step():
        with gg.trace():
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
        return loss.item()

    for _ in range(5):  # optimizer state exists after the first steps
        step()
    before = local_grid.stats()["workers"]
    for _ in range(1000):
        step()
    after = local_grid.stats()["workers"]
    assert {w: s["objects"] for w, s in after.items()} == {
        w: s["objects"] for w, s in before.items()
    }


def test_backward_with_unrequested_grads_stays_deferred(local_grid):
    """convolution_backward returns None for grads nobody needs; that is not data-dependent."""
    torch.manual_seed(0)
    conv = nn.Conv2d(2, 3, 3, bias=False)
    local = copy.deepcopy(conv)
    conv.send(local_grid.workers[0])
    X = torch.randn(1, 2, 5, 5)
    x = gg.send(X, local_grid.workers[1])  # the input does not require grad
    local_grid.reset_stats()
    with gg.trace():
        conv(x).sum().backward()
    assert local_grid.stats()["messages"] == 0  # still recorded, nothing ran
    local(X).sum().backward()
    torch.testing.assert_close(conv.weight.grad.get(), local.weight.grad)


@pytest.mark.parametrize("traced", [True, False], ids=["traced", "eager"])
def test_gradients_through_in_place_shape_changes(local_grid, traced):
    """t_ and unsqueeze_ on a result and on a view of it, then backward, as in torch."""

    def f(a):
        v = a * 2
        v.t_()
        row = v[0]
        row.unsqueeze_(0)
        return (row * torch.arange(3.0)).sum() + v.sum()

    a = torch.randn(3, 2, requires_grad=True)
    f(a).backward()
    p = gg.send(a.detach(), local_grid.workers[0]).requires_grad_(True)
    with gg.trace() if traced else contextlib.nullcontext():
        f(p).backward()
    torch.testing.assert_close(p.grad.get(), a.grad)
