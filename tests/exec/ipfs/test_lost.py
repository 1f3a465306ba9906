"""A worker SIGKILLed under a compiled training step on real Kubo (exec/client/lost.py): the
step raises `WorkerLost` naming the layer it held; called again without sending anything,
`WorkerLost` again (never an internal error), the layers on the workers left readable as
they were; the model sent again to those workers trains as plain torch does."""

from __future__ import annotations

import copy
import os
import signal
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gridgraph as gg
from tests.exec.ipfs.fixtures import start_workers, stop_all

pytestmark = [pytest.mark.ipfs, pytest.mark.filterwarnings("ignore::gridgraph.RecompileWarning")]


def train(model: nn.Module, opt: torch.optim.Optimizer, x, y):
    opt.zero_grad()
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss


@pytest.mark.parametrize("killed", ["between steps", "under a step"])
def test_a_compiled_step_after_a_worker_is_killed_leaves_the_grid_usable(
    kubo_nodes, ipfs_workers, tmp_path, killed
):
    [wk] = start_workers([(kubo_nodes[1], "wk")], tmp_path)
    try:
        with gg.connect(ipfs=kubo_nodes[0].api, workers=["w0", "wk"], timeout=30) as grid:
            w0, k = grid.workers
            torch.manual_seed(0)
            X, Y = torch.randn(6, 4), torch.randn(6, 2)
            plain = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
            state = {"model": copy.deepcopy(plain)}
            plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
            state["model"][0].send(w0)
            state["model"][2].send(k)
            state["opt"] = torch.optim.SGD(state["model"].parameters(), lr=0.1, momentum=0.9)
            x, y = X.send(w0), Y.send(w0)

            @gg.compile
            def step(x, y):
                return train(state["model"], state["opt"], x, y)

            for _ in range(3):
                step(x, y).item()
                train(plain, plain_opt, X, Y)
            first = state["model"][0]
            os.kill(wk.proc.pid, signal.SIGKILL)
            wk.proc.wait()
            if killed == "between steps":  # the client hears nothing more from it first
                deadline = time.monotonic() + 20
                while not grid.client.requests.gone("wk"):
                    assert time.monotonic() < deadline
                    time.sleep(0.2)
            with pytest.raises(gg.WorkerLost, match="'wk'") as lost:
                step(x, y).item()
            assert any(".weight (2, 8)" in v for v in lost.value.values), lost.value.values
            with pytest.raises(gg.WorkerLost):  # before: ValueError, and pending nodes kept
                step(x, y).item()
            assert not grid.client.graph.pending
            assert [w.name for w in grid.workers] == ["w0"]
            if killed == "between steps":  # the step never ran: w0's layer is as it was
                torch.testing.assert_close(first.weight.get(), plain[0].weight)
                torch.testing.assert_close(first.bias.get(), plain[0].bias)
            state["model"] = copy.deepcopy(plain)
            state["model"].send(w0)
            state["opt"] = torch.optim.SGD(state["model"].parameters(), lr=0.1, momentum=0.9)
            state["opt"].load_state_dict(plain_opt.state_dict())
            for s in state["opt"].state.values():
                s["momentum_buffer"] = s["momentum_buffer"].send(w0)
            for _ in range(3):
                torch.testing.assert_close(step(x, y).get(), train(plain, plain_opt, X, Y))
    finally:
        stop_all([wk])
