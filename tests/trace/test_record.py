"""Recording's bookkeeping: every node names the user's own file:line, on the first call of
an op and on the recipe cache's hits alike, through module code, autograd and optimizers."""

from __future__ import annotations

import sys

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
