"""explain_plan's text and render's drawings (.dot, .svg, .png, .html)."""

from __future__ import annotations

import shutil

import pytest
import torch

import gridgraph as gg
from gridgraph.schedule import explain
from gridgraph.schedule.cost import CostModel
from gridgraph.schedule.explain import explain_plan, render
from gridgraph.schedule.place import naive_placement, place
from gridgraph.schedule.plan import split
from tests.schedule.graphs import WORKERS, two_tower


@pytest.fixture
def traced(local_grid):
    """y = relu(x @ W).sum(1) with x on w0 and W on w1; w2 holds nothing."""
    w0, w1, _ = local_grid.workers
    x = gg.send(torch.randn(64, 32), w0)
    W = gg.send(torch.randn(32, 8), w1)
    with gg.trace():
        y = torch.relu(x @ W).sum(1)
    client = local_grid.client
    nodes = [client.graph.node(n) for n in sorted(client.graph.needed_for([y._vid]))]
    values = client.graph.values
    placement = place(nodes, values, client.workers)
    plan = split(nodes, placement, values, keep={y._vid})
    naive = split(nodes, naive_placement(nodes, values), values, keep={y._vid})
    return nodes, values, placement, plan, naive


def test_explain_names_ops_lines_transfers_and_the_naive_placement(traced):
    nodes, values, placement, plan, naive = traced
    text = explain_plan(nodes, values, placement, plan, naive, CostModel.local(), WORKERS)
    assert text.startswith("placement: 3 ops on 1 of 3 workers, 2 stages, 1 transfer, 1.0 KB")
    assert "naive placement (each op where its largest input lives): 1 transfer" in text
    for w in WORKERS:
        assert f"\n{w}: " in text
    assert "w2: 0 ops" in text
    for n in nodes:
        assert n.name in text and n.meta["where"] in text  # the user's own file:line
    assert __file__ in text
    # W (32x8 float32, 1 KB) comes from w1 for the stage that uses it.
    assert f"%{plan.transfers[0].value} 32x8 float32: w1 -> w0, 1.0 KB  (for stage 1)" in text


def test_explain_counts_bytes_and_stages_of_a_spread_graph():
    b = two_tower(d=512, depth=3)
    p = place(b.nodes, b.values, WORKERS, CostModel.local())
    plan = split(b.nodes, p, b.values, keep=set())
    naive = split(b.nodes, naive_placement(b.nodes, b.values), b.values, keep=set())
    text = explain_plan(b.nodes, b.values, p, plan, naive, CostModel.local())
    assert f"{plan.n_stages} stages, {len(plan.transfers)} transfers" in text
    assert text.count(" -> ") == len(plan.transfers)
    assert f"transfers: {len(plan.transfers)}, {explain.human_bytes(plan.bytes_moved)}" in text
    stages = explain.node_stages(b.nodes, p, plan)
    assert max(stages.values()) == plan.n_stages - 1


def test_dot_has_a_cluster_per_worker_stages_and_labelled_transfers(traced, tmp_path):
    nodes, values, placement, plan, _ = traced
    path = render(nodes, values, placement, plan, str(tmp_path / "p.dot"), WORKERS)
    dot = open(path).read()
    for w in WORKERS:
        assert f'subgraph "cluster_{w}"' in dot and f'label="{w}"' in dot
    assert "idle" in dot  # w2 has nothing to do, and still shows
    assert 'label="stage 1"' in dot and "\\ns1" in dot
    assert dot.count("penwidth=2.5") == len(plan.transfers) == 1
    assert 'label="%' in dot and ': 1.0 KB"' in dot


def test_dot_draws_one_bold_edge_per_transfer():
    b = two_tower(d=512, depth=3)
    p = place(b.nodes, b.values, WORKERS, CostModel.pubsub())
    plan = split(b.nodes, p, b.values, keep=set())
    assert len(plan.transfers) >= 2
    dot = explain.to_dot(b.nodes, b.values, p, plan)
    assert dot.count("penwidth=2.5") == len(plan.transfers)
    for t in plan.transfers:
        assert f'label="%{t.value}: {explain.human_bytes(t.nbytes)}"' in dot


@pytest.mark.skipif(shutil.which("dot") is None, reason="needs Graphviz's dot")
@pytest.mark.parametrize("ext", ["svg", "html", "png"])
def test_render_names_every_worker(traced, tmp_path, ext):
    nodes, values, placement, plan, _ = traced
    path = render(nodes, values, placement, plan, str(tmp_path / f"placement.{ext}"), WORKERS)
    data = open(path, "rb").read()
    if ext == "png":
        assert data.startswith(b"\x89PNG") and len(data) > 1000
        return
    text = data.decode()
    assert "<svg" in text and (ext == "svg" or text.startswith("<!DOCTYPE html>"))
    for w in WORKERS:
        assert f">{w}</text>" in text


def test_render_errors(traced, tmp_path, monkeypatch):
    nodes, values, placement, plan, _ = traced
    with pytest.raises(ValueError, match=r"\.dot, \.svg, \.png or \.html"):
        render(nodes, values, placement, plan, str(tmp_path / "p.pdf"))
    monkeypatch.setattr(explain.shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match="install graphviz"):
        render(nodes, values, placement, plan, str(tmp_path / "p.svg"))
    render(nodes, values, placement, plan, str(tmp_path / "p.dot"))  # needs no Graphviz


def test_gg_explain_and_visualize_on_pointers(local_grid, tmp_path):
    w0, w1, _ = local_grid.workers
    x = gg.send(torch.randn(64, 32), w0)
    W = gg.send(torch.randn(32, 8), w1)
    with gg.trace():
        y = torch.relu(x @ W).sum(1)
        z = y * 2
    summary = gg.explain([y, z])
    assert "naive placement" in summary and "w0" in summary and "w2: 0 ops" in summary
    assert __file__ in summary  # the ops are attributed to this file's lines
    assert gg.explain(local_grid).startswith("placement:")
    for ext in ("svg", "dot", "html"):
        path = gg.visualize(y, str(tmp_path / f"placement.{ext}"))
        content = open(path).read()
        assert all(w.name in content for w in local_grid.workers)
    local_grid.reset_stats()
    gg.explain(z)  # explaining runs nothing
    assert local_grid.stats()["messages"] == 0 and not z.computed
    z.compute()
    assert gg.explain(z).startswith("nothing to run")
