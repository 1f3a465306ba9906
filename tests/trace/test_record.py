"""Recording's bookkeeping: every node names the user's own file:line, on the first call of
an op and on the recipe cache's hits alike, through module code, autograd and optimizers."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gridgraph as gg
from gridgraph.trace import record


class _NewNodes:
    """The nodes a grid's client recorded since the previous call."""

    def __init__(self, grid) -> None:
        self.graph = grid.client.graph
        self.seen = {n.id for n in self.graph.nodes()}

    def __call__(self) -> list:
        new = [n for n in self.graph.nodes() if n.id not in self.seen]
        self.seen |= {n.id for n in new}
        return new


def test_each_node_names_the_users_line(local_grid):
    grid = local_grid
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2)).send(grid.workers[0])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = gg.send(torch.randn(5, 4), grid.workers[1])
    for _ in range(2):  # the second time, every op's recipe comes from the cache
        new_nodes = _NewNodes(grid)
        parts = []  # (nodes, the line that recorded them)
        with gg.trace():
            # Each statement and the line number it reads are on one line.
            y = x * 2; parts.append((new_nodes(), sys._getframe().f_lineno))  # fmt: skip  # noqa: E702
            out = model(y); parts.append((new_nodes(), sys._getframe().f_lineno))  # fmt: skip  # noqa: E702
            loss = F.mse_loss(out, torch.zeros(5, 2)); parts.append((new_nodes(), sys._getframe().f_lineno))  # fmt: skip  # noqa: E501, E702
            loss.backward(); parts.append((new_nodes(), sys._getframe().f_lineno))  # fmt: skip  # noqa: E702
            opt.step(); parts.append((new_nodes(), sys._getframe().f_lineno))  # fmt: skip  # noqa: E702
        for nodes, line in parts:
            assert nodes, "each statement records ops"
            for n in nodes:
                assert n.meta["where"] == f"{__file__}:{line}", n
        loss.item()
        opt.zero_grad()


def test_no_frame_of_the_users_reads_unknown():
    assert record.user_frame(skip=10_000) == "<unknown>"


def test_an_out_form_runs_as_its_op_and_a_copy_into_out(local_grid):
    w = local_grid.workers[0]
    a, b, o = torch.randn(4, 3), torch.randn(3, 5), torch.zeros(4, 5)
    pa, pb, po = a.send(w), b.send(w), o.send(w)
    returned = torch.mm(pa, pb, out=po)  # eager
    assert returned is po
    assert torch.equal(po.get(), torch.mm(a, b))
    with gg.trace():
        torch.amax(pa, 1, out=po[:, 0])
    assert torch.equal(po.get()[:, 0], torch.amax(a, 1))


def test_an_out_tensor_that_torch_would_resize_or_cast_is_refused(local_grid):
    w = local_grid.workers[0]
    pa, pb = torch.randn(4, 3).send(w), torch.randn(3, 5).send(w)
    for out in (torch.zeros(2, 2), torch.zeros(4, 5, dtype=torch.float64)):
        po = out.send(w)
        with pytest.raises(gg.RecordError, match="out= tensor"):
            torch.mm(pa, pb, out=po)
        assert torch.equal(po.get(), out)  # nothing written
