"""Tensors a decomposition (or a custom op's backward) allocates live beside its pointers.

torch's own Python implementations allocate scratch buffers on their inputs' device and
write into them (`torch.mm(a, b, out=buffer)`); `nn.LinearCrossEntropyLoss` does, in its
forward and its backward. Through pointers those buffers are made on a worker, so the
writes of remote data into them are recorded; before, they were local tensors and the
write was refused ("an op writes to a local tensor using remote data").
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import gridgraph as gg


@torch.library.custom_op("gridgraph_test::scaled_matmul", mutates_args=())
def scaled_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    out = torch.empty(a.shape[0], b.shape[1], device=a.device)  # a scratch buffer
    torch.mm(a, b, out=out)
    scale = torch.full((1,), 2.0, device=a.device)
    return out.mul_(scale)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad):
    a, b = ctx.saved_tensors
    grad_a = torch.zeros(a.shape, device=grad.device)  # an accumulator
    grad_a.add_(torch.mm(grad, b.T), alpha=2.0)
    grad_b = torch.empty(b.shape, device=grad.device)
    torch.mm(a.T, grad, out=grad_b)
    return grad_a, grad_b.mul_(2.0)


scaled_matmul.register_autograd(_backward, setup_context=_setup)


@pytest.mark.parametrize("traced", [True, False], ids=["traced", "eager"])
def test_a_custom_op_that_writes_into_its_own_buffers_runs_and_trains(local_grid, traced):
    a, b = torch.randn(4, 3, requires_grad=True), torch.randn(3, 5, requires_grad=True)
    want = scaled_matmul(a, b)
    want_grads = torch.autograd.grad(want.sum(), (a, b))
    w0, w1, _ = local_grid.workers
    pa = gg.send(a.detach(), w0).requires_grad_()
    pb = gg.send(b.detach(), w1).requires_grad_()
    with gg.trace() if traced else contextlib.nullcontext():
        got = scaled_matmul(pa, pb)
        grads = torch.autograd.grad(got.sum(), (pa, pb))
    assert isinstance(got, gg.RemoteTensor) and all(isinstance(g, gg.RemoteTensor) for g in grads)
    torch.testing.assert_close(got.get(), want.detach())
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g.get(), w)


def test_its_backward_allocates_beside_what_it_saved_given_local_gradients(local_grid):
    a, b = torch.randn(4, 3, requires_grad=True), torch.randn(3, 5, requires_grad=True)
    cotangent = torch.randn(4, 5)  # a local gradient for a pointer's op
    want = torch.autograd.grad(scaled_matmul(a, b), (a, b), cotangent)
    pa = gg.send(a.detach(), local_grid.workers[0]).requires_grad_()
    pb = gg.send(b.detach(), local_grid.workers[1]).requires_grad_()
    got = torch.autograd.grad(scaled_matmul(pa, pb), (pa, pb), cotangent)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.get(), w)


def test_the_same_op_on_local_tensors_allocates_locally():
    a, b = torch.randn(4, 3, requires_grad=True), torch.randn(3, 5, requires_grad=True)
    out = scaled_matmul(a, b)
    grads = torch.autograd.grad(out.sum(), (a, b))
    assert type(out) is torch.Tensor and all(type(g) is torch.Tensor for g in grads)
    torch.testing.assert_close(out, 2 * a @ b)


@pytest.mark.skipif(
    not hasattr(torch.nn, "LinearCrossEntropyOptions"),
    reason="torch before 2.15 has no chunked loss",
)
def test_linear_cross_entropy_chunked_without_reduction_trains(local_grid):
    torch.manual_seed(0)
    chunked = torch.nn.LinearCrossEntropyOptions(chunking_method="auto")
    loss = torch.nn.LinearCrossEntropyLoss(5, 4, reduction="none", options=chunked)
    x, target = torch.randn(8, 5, requires_grad=True), torch.randint(0, 4, (8,))
    want = loss(x, target)
    want.sum().backward()
    remote = torch.nn.LinearCrossEntropyLoss(5, 4, reduction="none", options=chunked)
    remote.load_state_dict(loss.state_dict())
    gg.send(remote, local_grid.workers[0])
    px = gg.send(x.detach(), local_grid.workers[1]).requires_grad_()
    got = remote(px, gg.send(target, local_grid.workers[1]))
    got.sum().backward()
    torch.testing.assert_close(got.get(), want.detach())
    torch.testing.assert_close(px.grad.get(), x.grad)
    (weight,) = remote.parameters()
    torch.testing.assert_close(weight.grad.get(), next(loss.parameters()).grad)
