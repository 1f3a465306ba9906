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
    plain = data.send(w0)  # noqa: F841  (a send the line assigns: the name assigned)
    kept = [data.send(w0)]  # noqa: F841  (a send inside a list the line assigns)
    ones = torch.ones(2).send(w0) * 1  # the product is `ones`, not the tensor sent
    assert graph.label(x._vid) == "x" and graph.label(batch._vid) == "batch"
    named = {graph.user_name(v) for v in graph.values}
    assert named >= {"plain", "data"}, named  # `data`: the local variable bound to it
    assert graph.user_name(ones._vid) is None and "ones" not in named


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
    sent = [t.send(w0) for t in [torch.zeros(2)]]  # `sent` is the list: its items are sent
    names = {graph.user_name(v) for v in graph.values}
    assert "doubled" not in names and "sent" not in names, names
    assert graph.user_name(sent[0]._vid) == "sent[...]"  # (the list it loops over has no name)
    assert graph.user_name(doubled._vid) is None


def _is_what_the_user_wrote(graph, pointer, scope) -> bool:
    """Whether the name a pointer is called by is an expression for that very pointer."""
    name = graph.user_name(pointer._vid)
    return name is not None and eval(name, {}, scope) is pointer


def test_two_sends_on_one_line_are_each_called_by_the_name_assigned(local_grid):
    w0, w1, _ = local_grid.workers
    graph = local_grid.client.graph
    data = torch.randn(2)
    a, b = data.send(w0), torch.ones(2).send(w1)
    c = gg.send(torch.ones(1), w0); d = torch.zeros(1).send(w1)  # fmt: skip  # noqa: E702
    assert [graph.user_name(p._vid) for p in (a, b, c, d)] == ["a", "b", "c", "d"]
    scope = locals()
    assert all(_is_what_the_user_wrote(graph, p, scope) for p in (a, b, c, d))


def test_sends_in_a_list_comprehension_are_called_by_their_place_in_the_list(local_grid):
    workers = local_grid.workers
    graph = local_grid.client.graph
    ts = [torch.randn(2) for _ in range(3)]
    xs = [t.send(workers[0]) for t in ts]
    ys = [t.send(w) for t, w in zip(ts, workers)]
    zs = [ts[i].send(workers[1]) for i in range(3)]
    es = [t.send(workers[2]) for i, t in enumerate(ts)]
    scope = locals()
    for pointers in (xs, ys, zs, es):
        assert all(_is_what_the_user_wrote(graph, p, scope) for p in pointers), [
            graph.user_name(p._vid) for p in pointers
        ]
    # where the place cannot be known (a filter: it is not the place in `ts`), the list's name
    kept = [t.send(workers[0]) for t in ts if t.sum() > -100]
    assert {graph.user_name(p._vid) for p in kept} == {"kept[...]"}


def test_a_send_split_over_several_lines_is_called_by_the_name_assigned(local_grid):
    w0, w1, _ = local_grid.workers
    graph = local_grid.client.graph
    weights = torch.zeros(
        3,
        4,
    ).send(
        w0,
    )
    encoder, decoder, head = torch.nn.Linear(3, 4), torch.nn.Linear(4, 3), torch.nn.Linear(3, 1)
    gg.send(
        encoder,
        w1,
    )
    decoder.send(w0); head.send(w1)  # fmt: skip  # noqa: E702  (two modules on one line)
    assert graph.user_name(weights._vid) == "weights"
    assert graph.user_name(decoder.weight._vid) == "decoder.weight"
    assert graph.user_name(encoder.bias._vid) == "encoder.bias"
    assert graph.user_name(head.weight._vid) == "head.weight"


def test_optimizer_state_is_called_by_its_parameter_and_its_key(local_grid):
    w0, w1, _ = local_grid.workers
    graph = local_grid.client.graph
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    head = torch.nn.Linear(2, 1)
    model.send(w0)
    head.send(w1)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    adam = torch.optim.Adam(head.parameters())
    local = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1, momentum=0.9)
    for _ in range(2):
        with gg.trace():
            model(torch.randn(5, 3).send(w0)).sum().backward()
            head(torch.randn(5, 2).send(w1)).sum().backward()
            sgd.step()
            adam.step()
    assert {graph.user_name(s["momentum_buffer"]._vid) for s in sgd.state.values()} == {
        f"model.{name}.momentum_buffer" for name, _ in model.named_parameters()
    }
    assert graph.user_name(adam.state[head.bias]["exp_avg_sq"]._vid) == "head.bias.exp_avg_sq"
    assert "model.2.weight.momentum_buffer" in gg.explain(list(model.parameters()))
    local.step()  # (an optimizer of local tensors: left alone)
