"""The compact picture: a README training step folds into a screenful of boxes."""

from __future__ import annotations

import re
import shutil
import struct

import networkx as nx
import pytest
import torch

import gridgraph as gg
from gridgraph.schedule import compact
from gridgraph.schedule.explain import node_stages


@pytest.fixture
def mlp_step(local_grid):
    """The README's MLP, one full step recorded (not run) after a first one has run."""
    torch.manual_seed(0)
    X, Y = torch.randn(256, 16), torch.randint(0, 2, (256,))
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))
    w0, w1, w2 = local_grid.workers
    model[0].send(w0)
    model[2].send(w1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = X.send(w0), Y.send(w2)
    for step in range(2):
        with gg.trace():
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
        if step == 0:  # run all of the first step: the second is what is drawn
            state = [t for s in opt.state.values() for t in s.values() if t.dim()]
            gg.compute(*model.parameters(), *state)
    return local_grid


def test_a_training_step_folds_into_a_box_per_module_call_and_line(mlp_step):
    client = mlp_step.client
    nodes = client.graph.nodes()
    _, placement, plan = client.compile([v for n in nodes for v in n.outputs])
    boxes, box_of = compact.boxes(nodes, placement, node_stages(nodes, placement, plan))
    assert sorted(n.id for b in boxes for n in b.nodes) == sorted(n.id for n in nodes)
    titles = {b.title for b in boxes}
    assert {"model[0] (Linear)", "model[2] (Linear)", "model[0] (Linear) backward",
            "model[2] (Linear) backward", "loss.backward()", "opt.step()"} <= titles  # fmt: skip
    lines = [b for b in boxes if b.key[0] == "line"]
    assert not any(
        len(b.nodes) == 1 and b.nodes[0].op._schema.name in compact.FOLDED for b in lines
    )  # views, detaches and clones outside modules join the box of what they re-present
    # 12 boxes (61 ops on torch 2.15, 65 on 2.6, whose decompositions differ): each module
    # call forward and backward (parts on two workers), the loss line before and after
    # model[2], loss.backward() twice, opt.step() per worker
    assert len(boxes) == 12
    edges = nx.DiGraph(
        (id(box_of[p]), id(box_of[n.id])) for n in nodes for p in client.graph.preds[n.id]
    )
    edges.remove_edges_from(nx.selfloop_edges(edges))
    assert nx.is_directed_acyclic_graph(edges)


def test_the_compact_dot_names_values_and_hides_unnamed_state(mlp_step, tmp_path):
    dot = open(gg.visualize(mlp_step, str(tmp_path / "step.dot"))).read()
    for name in ("model[0].weight", "model[2].bias", "x\\n256x16", "y\\n256 int64"):
        assert name in dot
    assert "reads 4 stored" in dot  # Adam's exp_avg and exp_avg_sq of two parameters
    assert "@" not in re.sub(r"tooltip=\"[^\"]*\"", "", dot)  # no op@line ellipses drawn
    full = open(gg.visualize(mlp_step, str(tmp_path / "full.dot"), full=True)).read()
    ops = len(mlp_step.client.graph.nodes())
    assert len(re.findall(r"^ +n\d+ \[label", full, re.M)) == ops  # every op, one node each


@pytest.mark.skipif(shutil.which("dot") is None, reason="needs Graphviz's dot")
def test_the_picture_of_a_training_step_fits_a_screen(mlp_step, tmp_path):
    png = open(gg.visualize(mlp_step, str(tmp_path / "step.png")), "rb").read()
    width, height = struct.unpack(">II", png[16:24])
    print(f"compact picture of the README MLP step: {width}x{height} px")
    assert width <= 1600 and height <= 1400


def test_calls_of_modules_without_tensors_join_their_neighbour(local_grid):
    w0 = local_grid.workers[0]
    features = torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3), torch.nn.ReLU(), torch.nn.MaxPool2d(2), torch.nn.Flatten()
    )
    features.send(w0)
    x = torch.randn(2, 1, 8, 8).send(w0)
    with gg.trace():
        features(x).sum().backward()
    client = local_grid.client
    nodes = client.graph.nodes()
    _, placement, plan = client.compile([v for n in nodes for v in n.outputs])
    boxes, box_of = compact.boxes(nodes, placement, node_stages(nodes, placement, plan))
    labels = {b.label().split("\n")[0] for b in boxes}
    assert "features.0 (Conv2d) + ReLU + MaxPool2d + Flatten" in labels
    assert "features.0 (Conv2d) + ReLU + MaxPool2d + Flatten backward" in labels
    assert len(boxes) == 3  # forward, backward, and the line that sums and calls backward
    assert all(any(b is box for b in boxes) for box in box_of.values())
