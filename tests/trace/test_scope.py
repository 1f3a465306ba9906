"""Ops recorded in a sent module's forward, and in its backward, carry the module call."""

from __future__ import annotations

import torch

import gridgraph as gg
from gridgraph.trace import scope


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.inner(x)) * 2  # tanh and mul are Block's own ops


def _scopes(graph) -> list[tuple[str, tuple[str, int, bool] | None]]:
    return [(n.op._schema.name, n.meta.get("scope")) for n in graph.nodes()]


def test_forward_ops_carry_the_innermost_module_call(local_grid):
    model = torch.nn.Sequential(Block(), Block())
    model.send(local_grid.workers[0])
    x = torch.randn(3, 4).send(local_grid.workers[0])
    with gg.trace():
        model(x).sum()
    scopes = _scopes(local_grid.client.graph)
    labels = [s[0] if s else None for _, s in scopes]
    # t, addmm in Linear; tanh, detach (autograd keeps tanh's output), mul in Block
    assert labels == [
        *["model.0.inner (Linear)"] * 2, *["model.0 (Block)"] * 3,
        *["model.1.inner (Linear)"] * 2, *["model.1 (Block)"] * 3,
        None,  # .sum() outside the model
    ]  # fmt: skip
    calls = {s for _, s in scopes if s}
    assert len(calls) == 4  # each call its own number


def test_a_module_called_twice_is_two_calls_and_backward_is_named(local_grid):
    layer = torch.nn.Linear(4, 4)
    layer.send(local_grid.workers[0])
    x = torch.randn(3, 4).send(local_grid.workers[0])
    with gg.trace():
        layer(layer(x)).sum().backward()
    scopes = [s for _, s in _scopes(local_grid.client.graph) if s]
    forward = {s for s in scopes if s[0] == "layer (Linear)"}
    backward = {s for s in scopes if s[0] == "layer (Linear) backward"}
    assert len(forward) == 2 and {s[1] for s in backward} == {s[1] for s in forward}
    ops = {op for op, s in _scopes(local_grid.client.graph) if s in backward}
    assert "aten::mm" in ops  # the weight's and input's gradients


def test_labelling_again_relabels_without_hooking_twice():
    layer = torch.nn.Linear(2, 2)
    scope.label_module(layer, "first")
    scope.label_module(layer, "second")
    assert (len(layer._forward_hooks), len(layer._forward_pre_hooks)) == (1, 1)
    assert layer._gg_scope == "second (Linear)"


class Fails(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) @ torch.ones(3, 3)  # a shape error, as one makes in a notebook


def test_a_forward_that_raises_leaves_no_module_call_open(local_grid):
    model = Fails()
    model.send(local_grid.workers[0])
    x = torch.randn(3, 4).send(local_grid.workers[0])
    try:
        with gg.trace():
            model(x)
    except Exception:
        pass
    with gg.trace():
        (x * 2).sum()  # outside any module: no module call's label
    after = [
        (op, s) for op, s in _scopes(local_grid.client.graph) if op in ("aten::mul", "aten::sum")
    ]
    assert after == [("aten::mul", None), ("aten::sum", None)]
    assert scope._running[0] == 0


class ByKeyword(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Linear(4, 4)

    def forward(self, *, h: torch.Tensor) -> torch.Tensor:
        return self.inner(h)


def test_a_module_called_by_keyword_labels_only_its_own_backward(local_grid):
    model = ByKeyword()
    model.send(local_grid.workers[0])
    w = torch.randn(3, 4, requires_grad=True).send(local_grid.workers[0])
    with gg.trace():
        model(h=torch.relu(w)).sum().backward()  # relu: the user's, before the module
    backward = [s for op, s in _scopes(local_grid.client.graph) if op == "aten::threshold_backward"]
    assert backward == [None]
