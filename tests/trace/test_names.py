"""Values carry the names users gave them: explain, pictures and errors call them so."""

from __future__ import annotations

import pytest
import torch

import gridgraph as gg
from tests.source_lines import line_of


def _line_of(text: str) -> int:
    return line_of(__file__, text)


def test_a_sent_tensor_is_called_by_the_name_the_line_assigns(local_grid):
    w0 = local_grid.workers[0]
    graph = local_grid.client.graph
    x = torch.randn(4, 3).send(w0)
    batch = gg.send(torch.randn(4, 3), w0)
    data = torch.randn(2)
    a, b = data.send(w0), torch.ones(2).send(w0)  # two sends on one line: no guessing
    assert graph.label(x._vid) == "x" and graph.label(batch._vid) == "batch"
    assert graph.label(a._vid) == "data"  # the local variable bound to the tensor sent
    assert graph.user_name(b._vid) is None and graph.label(b._vid).startswith("%")


def test_parameters_are_called_by_their_names_in_the_module_and_keep_them(local_grid):
    w0, w1, _ = local_grid.workers
    graph = local_grid.client.graph
    features = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    head = torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Linear(4, 2))
    features.send(w0)
    head[1].send(w1)  # a part of a model: its expression prefixes the names
    assert graph.label(features[0].weight._vid) == "features.0.weight"
    assert graph.label(features[1].running_mean._vid) == "features.1.running_mean"  # buffers
    assert graph.label(head[1].bias._vid) == "head[1].bias"
    opt = torch.optim.SGD([*features.parameters(), *head.parameters()], lr=0.1)
    with gg.trace():
        head(features(torch.randn(5, 3))).sum().backward()
        opt.step()
    gg.compute(*features.parameters(), *head.parameters())
    # new versions of the same storage (in-place updates) keep the name; views say so
    assert graph.label(features[0].weight._vid) == "features.0.weight"
    assert graph.label(head[1].weight.t()._vid) == "view of head[1].weight"
    assert graph.label(features[0].weight.grad._vid) == "features.0.weight.grad"


def test_a_value_without_a_name_is_called_by_its_op_and_line(local_grid):
    x = torch.randn(4).send(local_grid.workers[0])
    with gg.trace():
        y = torch.relu(x) * 2
    graph = local_grid.client.graph
    line = _line_of("y = torch.relu(x) * 2")
    assert graph.label(y._vid) == f"mul@test_names.py:{line}"  # pending
    y.compute()
    assert graph.label(y._vid) == f"mul@test_names.py:{line}"  # and once it has run


def test_explain_shows_names_and_module_calls(local_grid):
    w0, w1, _ = local_grid.workers
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    model.send(w0)
    inputs = torch.randn(8, 3).send(w1)
    with gg.trace():
        loss = model(inputs).sum()
    text = gg.explain(loss)
    assert "view of model.0.weight 3x4 float32: w0 -> w1" in text  # a transfer, by name
    assert "aten::addmm(model.0.bias, inputs, view of model.0.weight)" in text  # inputs
    assert "[model.0 (Linear)]" in text and "[model.2 (Linear)]" in text  # the module call
    assert "[model.1 (ReLU)]" in text


def test_a_remote_error_names_what_the_op_read(local_grid):
    w0 = local_grid.workers[0]
    table = torch.randn(3, 4).send(w0)
    rows = torch.tensor([10]).send(w0)  # out of range: only the kernel can tell
    with gg.trace():
        picked = table.index_select(0, rows)
    with pytest.raises(gg.RemoteError) as info:
        picked.get()
    assert info.value.reads == ["table", "rows"]
    assert "reading table, rows)" in str(info.value)


def test_worker_lost_lists_the_tensors_it_held_by_name(local_grid, monkeypatch):
    w0, w1, _ = local_grid.workers
    model = torch.nn.Linear(3, 2).send(w1)
    x = torch.randn(4, 3).send(w0)
    with gg.trace():
        y = model(x)
    # w1 goes silent (its answers are lost) and looks gone, as a dead peer does on IPFS
    monkeypatch.setattr(local_grid.local_workers[1].transport, "publish", lambda *a, **k: None)
    local_grid.client.alive = lambda worker: worker != "w1"
    with pytest.raises(gg.WorkerLost) as info:
        y.get()
    lost = info.value.values
    assert any(v.startswith("weight (2, 3)") for v in lost), lost
    assert any(v.startswith("bias (2,)") for v in lost), lost


def test_a_send_inside_a_larger_expression_is_not_called_by_what_the_line_assigns(local_grid):
    w0 = local_grid.workers[0]
    graph = local_grid.client.graph
    doubled = torch.mul(torch.ones(3).send(w0), 2)  # `doubled` is the product, not the input
    sent = [t.send(w0) for t in [torch.zeros(2)]]  # `sent` is the list
    names = {graph.user_name(v) for v in graph.values}
    assert "doubled" not in names and "sent" not in names, names
    assert graph.label(sent[0]._vid) != "sent" and graph.user_name(doubled._vid) is None
