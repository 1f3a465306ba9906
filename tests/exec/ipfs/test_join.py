"""Workers that join a grid over real Kubo after `connect` (exec/client/lost.py, the keep-alive
in exec/ipfs/client.py): a worker started later is used for new plans; killed (SIGKILL) and
started again under its name, it is a new worker: the old process's tensors are lost with
`WorkerLost` naming them, and the new one computes."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

import gridgraph as gg
from tests.exec.ipfs.fixtures import start_workers, stop_all

pytestmark = pytest.mark.ipfs


def wait_for(condition, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def test_a_worker_started_after_connect_joins_and_a_restarted_one_is_a_new_worker(
    kubo_nodes, ipfs_workers, tmp_path
):
    with gg.connect(ipfs=kubo_nodes[0].api, min_workers=3, timeout=30) as grid:
        names = lambda: [w.name for w in grid.workers]  # noqa: E731
        assert "wj" not in names()
        [wj] = start_workers([(kubo_nodes[1], "wj")], tmp_path / "first")
        try:
            wait_for(lambda: "wj" in names())  # before: never, whatever the wait
            [ref] = [w for w in grid.workers if w.name == "wj"]
            a = torch.randn(5)
            x = a.send(ref)
            with gg.trace():
                y = x * 2 + 1
            torch.testing.assert_close(y.get(), a * 2 + 1)
            assert y.location == "wj"
            os.kill(wj.proc.pid, signal.SIGKILL)
            wj.proc.wait()
            [wj] = start_workers([(kubo_nodes[1], "wj")], tmp_path / "again")
            # The new process joins as a new worker: nothing of the old one is assumed there.
            wait_for(lambda: "wj" in names() and x._vid in grid.client.failed)
            with pytest.raises(gg.WorkerLost, match="'wj'") as lost:
                x.get()
            assert any(v.startswith("x (5,)") for v in lost.value.values), lost.value.values
            [ref] = [w for w in grid.workers if w.name == "wj"]
            b = torch.randn(3)
            z = b.send(ref)
            with gg.trace():
                s = z.sum()
            torch.testing.assert_close(s.get(), b.sum())
        finally:
            stop_all([wj])
