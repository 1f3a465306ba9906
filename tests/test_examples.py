"""The examples run as their docs say, on both transports."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from examples import multinode_demo


def test_the_multinode_demo_fits_as_torch_does_and_no_shard_leaves_its_worker(grid):
    xs, ys, _ = multinode_demo.shards(len(grid.workers))
    remote_x = [x.send(w) for x, w in zip(xs, grid.workers)]
    remote_y = [y.send(w) for y, w in zip(ys, grid.workers)]
    w = torch.zeros(8, 1).send(grid.workers[0])
    steps = 8
    grid.reset_stats()
    fitted = multinode_demo.fit(remote_x, remote_y, w, steps, lr=0.1, homes=grid.workers)
    want = multinode_demo.fit(xs, ys, torch.zeros(8, 1), steps, lr=0.1)
    torch.testing.assert_close(fitted.get(), want)
    moved = grid.stats()["bytes"] / steps
    print(f"bytes per step: {moved:.0f}")
    assert moved < xs[0].nbytes / 4  # weights and gradients travel, never a shard's rows


def test_the_cnn_notebook_runs_from_top_to_bottom(tmp_path, monkeypatch):
    """examples/train_cnn.ipynb trains, explains and draws; its own asserts check names."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    root = Path(__file__).parents[1]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    notebook = nbformat.read(root / "examples" / "train_cnn.ipynb", as_version=4)
    client = nbclient.NotebookClient(
        notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": tmp_path}}
    )
    client.execute()  # raises CellExecutionError, with the cell and its traceback, on failure
    printed = "".join(
        out.get("text", "") for cell in notebook.cells for out in cell.get("outputs", [])
    )
    assert "test accuracy: 1.00" in printed or "test accuracy: 0.9" in printed
    assert "replayed>" in printed and "features.0.weight.grad" in printed
    assert (tmp_path / "train_cnn_step.png").read_bytes().startswith(b"\x89PNG")
