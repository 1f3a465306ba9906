"""The placement compiler: alias units, pins, memory caps, chains, and quality vs the optimum."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gridgraph as gg
from gridgraph.schedule.cost import CostModel, bytes_moved, finish_time
from gridgraph.schedule.exact import exact_placement, free_units
from gridgraph.schedule.place import PlacementError, alias_units, naive_placement, place
from tests.schedule.graphs import (
    WORKERS,
    Builder,
    chain,
    far_weight_chain,
    random_dag,
    residual_cnn,
    two_tower,
)

aten = torch.ops.aten
MODELS = {"local": CostModel.local(), "pubsub": CostModel.pubsub()}


def pending(grid: gg.Grid):
    """The client's pending nodes (recording order) and its values."""
    return grid.client.graph.nodes(), grid.client.graph.values


def home_bytes(nodes, values, placement) -> dict[str, int]:
    """Bytes of the storages each worker is home to (stored there, or made there)."""
    size: dict[int, tuple[str, int]] = {}
    for n in nodes:
        for v in n.inputs():
            if values[v].location is not None:
                w, b = size.get(values[v].storage, (values[v].location, 0))
                size[values[v].storage] = (w, max(b, values[v].meta.nbytes))
        for v in n.outputs:
            w, b = size.get(values[v].storage, (placement[n.id], 0))
            size[values[v].storage] = (w, max(b, values[v].meta.nbytes))
    total: dict[str, int] = {}
    for w, b in size.values():
        total[w] = total.get(w, 0) + b
    return total


# --- constraints ----------------------------------------------------------------------------


def test_deterministic():
    b = random_dag(300, 3)
    first = place(b.nodes, b.values, WORKERS)
    assert all(place(b.nodes, b.values, WORKERS) == first for _ in range(2))
    assert set(first.values()) == set(WORKERS)  # it does spread this graph


def test_view_and_in_place_stay_with_their_base():
    b = Builder()
    big = b.stored((512, 512), "w0")
    base = b.stored((512, 512), "w1")
    v = b(aten.t.default, base)  # a view of a tensor stored on w1
    b(aten.relu_.default, v)  # written through the view
    h = b(aten.mm.default, big, big)  # a fresh storage, made where `place` likes
    hv = b(aten.view.default, h, [-1])
    b(aten.mul_.Tensor, hv, b(aten.view.default, base, [-1]))
    b(aten.add.Tensor, h, big)
    for cost in MODELS.values():
        p = place(b.nodes, b.values, WORKERS, cost)
        view, write, mm, view2, view3, mul_, _ = (p[n.id] for n in b.nodes)
        assert view == write == view3 == "w1"  # aliases of `base` run where it is stored
        assert mm == view2 == mul_  # h, its view, and the write through that view: one unit
    units = alias_units(b.nodes, b.values)
    assert len(units.members) == 3 and units.fixed == ["w1", None, None]


def test_traced_views_and_in_place_ops_stay_with_their_base(local_grid):
    w0, w1, _ = local_grid.workers
    x = gg.send(torch.randn(256, 256), w1)
    big = gg.send(torch.randn(256, 256), w0)
    with gg.trace():
        v = x[:, :128]  # a view of a stored tensor
        v.mul_(big[:, :128])  # written through the view, with data from w0
        y = (x @ big).relu_()  # y is new, relu_ writes it: one unit
        z = y.view(-1)
    nodes, values = pending(local_grid)
    p = place(nodes, values, local_grid.client.workers, CostModel.pubsub())
    by_name = {}
    for n in nodes:
        by_name.setdefault(n.name, []).append(p[n.id])
    assert by_name["aten::mul_.Tensor"] == ["w1"]
    assert p[nodes[-1].id] == p[nodes[-2].id] == by_name["aten::mm"][0]  # view, relu_, mm
    local_grid.client.place = lambda nodes, values, workers: place(nodes, values, workers)
    expected = torch.relu(x.get() @ big.get())  # x as modified through its view
    assert torch.allclose(z.get(), expected.view(-1), atol=1e-4)


def test_pins_are_respected(local_grid):
    w0, w1, w2 = local_grid.workers
    x = gg.send(torch.randn(64, 64), w0)
    with gg.trace():
        y = x @ x
        with gg.on(w2):
            z = y.relu()  # would otherwise stay on w0 with its data
            zt = z.t()
        out = zt.sum()
    nodes, values = pending(local_grid)
    p = place(nodes, values, local_grid.client.workers)
    names = {n.name: p[n.id] for n in nodes}
    assert names["aten::relu"] == names["aten::t"] == "w2"
    local_grid.client.place = lambda nodes, values, workers: place(nodes, values, workers)
    assert out.item() == pytest.approx((x.get() @ x.get()).relu().sum().item(), rel=1e-4)
    assert z.location == "w2"


def test_a_pin_moves_its_whole_alias_unit_but_never_stored_data():
    b = Builder()
    x = b.stored((256, 256), "w0")
    h = b(aten.mm.default, x, x)  # not pinned, but ...
    b(aten.relu_.default, b(aten.t.default, h), pin="w2")  # ... a write through its view is
    b(aten.t.default, x, pin="w1")  # a view of data stored on w0 cannot leave w0
    p = [place(b.nodes, b.values, WORKERS)[n.id] for n in b.nodes]
    assert p == ["w2", "w2", "w2", "w0"]
    assert naive_placement(b.nodes, b.values)[b.nodes[-1].id] == "w0"  # the same rule


def test_pin_to_an_unknown_worker_is_an_error():
    b = Builder()
    b(aten.relu.default, b.stored((4,), "w0"), pin="w9")
    with pytest.raises(PlacementError, match="graphs.py:1.*pinned to .w9."):
        place(b.nodes, b.values, WORKERS)


def test_memory_cap_is_respected():
    b = random_dag(120, 5, d=64)
    free = place(b.nodes, b.values, WORKERS, CostModel.pubsub())
    loads = home_bytes(b.nodes, b.values, free)
    cap = int(max(loads.values()) * 0.8)  # the uncapped placement does not fit
    capped = place(b.nodes, b.values, WORKERS, CostModel.pubsub(), memory_cap=cap)
    assert max(home_bytes(b.nodes, b.values, capped).values()) <= cap
    per_worker = {"w0": cap, "w1": cap * 2, "w2": cap // 2}
    capped = place(b.nodes, b.values, WORKERS, CostModel.pubsub(), memory_cap=per_worker)
    for w, used in home_bytes(b.nodes, b.values, capped).items():
        assert used <= per_worker[w]


def test_memory_cap_errors_say_what_does_not_fit():
    b = random_dag(40, 5, d=64)
    stored = 2 * 64 * 64 * 4  # random_dag stores two weights per worker
    with pytest.raises(PlacementError, match=r"worker 'w\d' must hold .*memory cap"):
        place(b.nodes, b.values, WORKERS, memory_cap=stored - 1)
    with pytest.raises(PlacementError, match="no worker has room.*graphs.py"):
        place(b.nodes, b.values, WORKERS, memory_cap=stored + 4 * 64 * 64 * 4)


# --- chains and branches --------------------------------------------------------------------


def test_chain_stays_where_its_data_is():
    b = chain([64, 128, 32, 256, 8], workers=["w1"])
    for cost in MODELS.values():
        p = place(b.nodes, b.values, WORKERS, cost)
        assert set(p.values()) == {"w1"} and bytes_moved(b.nodes, b.values, p) == 0


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("small_weight", [True, False])
def test_chain_moves_the_fewest_bytes(model, small_weight):
    cost = MODELS[model]
    b = far_weight_chain(small_weight)  # moves the 1 KB weight, or x reduced to 4 KB
    p = place(b.nodes, b.values, WORKERS, cost)
    fewest, _ = exact_placement(b.nodes, b.values, WORKERS, cost, objective="bytes")
    fastest, t = exact_placement(b.nodes, b.values, WORKERS, cost)
    least = 1024 if small_weight else 4096
    assert bytes_moved(b.nodes, b.values, p) == bytes_moved(b.nodes, b.values, fewest) == least
    assert finish_time(b.nodes, b.values, p, cost) == pytest.approx(t)
    assert bytes_moved(b.nodes, b.values, fastest) == least


def test_chain_prefetches_spread_weights_when_that_is_faster():
    """Weights stored elsewhere can be sent at time 0, in parallel with the compute, while an
    activation can only leave after the op that makes it: so the fastest placement of a chain
    over spread weights may move more bytes than the fewest (the objective is time)."""
    b = chain([64, 128, 32, 256, 8])
    cost = CostModel.pubsub()
    p = place(b.nodes, b.values, WORKERS, cost)
    _, best = exact_placement(b.nodes, b.values, WORKERS, cost)
    fewest, _ = exact_placement(b.nodes, b.values, WORKERS, cost, objective="bytes")
    assert finish_time(b.nodes, b.values, p, cost) == pytest.approx(best)
    assert best < finish_time(b.nodes, b.values, fewest, cost)


def _towers(d: int):
    """Two towers of mm -> relu over x, all data on w0."""
    b = Builder()
    x = b.stored((d, d), "w0")
    outs = []
    for _ in range(2):
        h = x
        for _ in range(3):
            h = b(aten.relu.default, b(aten.mm.default, h, b.stored((d, d), "w0")))
        outs.append(h)
    b(aten.sum.default, b(aten.add.Tensor, *outs))
    return b


# Workers on separate machines with fast links (not in-process workers, which share cores).
FAST_LINKS = CostModel(latency=50e-6, bandwidth=5e9)


def test_branches_spread_only_when_the_gain_pays_for_the_transfers():
    heavy = _towers(512)  # 268 MFLOP per mm: 5 ms, against 1 MB transfers at 5 GB/s
    p = place(heavy.nodes, heavy.values, WORKERS, FAST_LINKS)
    assert len(set(p.values())) == 2
    assert finish_time(heavy.nodes, heavy.values, p, FAST_LINKS) < 0.6 * finish_time(
        heavy.nodes, heavy.values, naive_placement(heavy.nodes, heavy.values), FAST_LINKS
    )
    light = _towers(32)  # microseconds of work: a 50 us message never pays
    p = place(light.nodes, light.values, WORKERS, FAST_LINKS)
    assert set(p.values()) == {"w0"}
    p = place(heavy.nodes, heavy.values, WORKERS, CostModel(latency=1.0))  # 1 s messages
    assert set(p.values()) == {"w0"}


# --- quality --------------------------------------------------------------------------------


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("seed", range(6))
def test_within_5_percent_of_the_optimum(model, seed):
    cost = MODELS[model]
    b = random_dag(8, seed, d=[64, 256, 512][seed % 3])
    assert free_units(b.nodes, b.values) <= 8
    p = place(b.nodes, b.values, WORKERS, cost)
    _, best = exact_placement(b.nodes, b.values, WORKERS, cost)
    assert finish_time(b.nodes, b.values, p, cost) <= 1.05 * best


def _mlp_step(grid: gg.Grid):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                          nn.Linear(64, 4))  # fmt: skip
    ref = copy.deepcopy(model)
    for layer, w in zip(model[::2], grid.workers):
        layer.send(w)
    x, y = torch.randn(16, 32), torch.randint(0, 4, (16,))
    xr, yr = gg.send(x, grid.workers[0]), gg.send(y, grid.workers[2])
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with gg.trace():
        opt.zero_grad()
        F.cross_entropy(model(xr), yr).backward()
        opt.step()
    return model, ref, (x, y)


@pytest.mark.parametrize("model", MODELS)
def test_never_slower_than_naive(local_grid, model):
    cost = MODELS[model]
    _mlp_step(local_grid)
    graphs = [pending(local_grid)]
    for b in (chain([64, 128, 32, 256, 8]), two_tower(), residual_cnn(), random_dag(300, 1)):
        graphs.append((b.nodes, b.values))
    for nodes, values in graphs:
        p = place(nodes, values, WORKERS, cost)
        naive = naive_placement(nodes, values)
        assert finish_time(nodes, values, p, cost) <= finish_time(nodes, values, naive, cost)


def test_training_step_placed_by_place_matches_local_torch(local_grid):
    """Aliasing kept end to end: in-place parameter and momentum updates land where the
    parameters live, and the numbers equal plain torch."""
    local_grid.client.place = lambda nodes, values, workers: place(
        nodes, values, workers, CostModel.pubsub()
    )
    model, ref, (x, y) = _mlp_step(local_grid)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    opt.zero_grad()
    F.cross_entropy(ref(x), y).backward()
    opt.step()
    for p, r in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(p.get(), r.detach(), atol=1e-5)
    assert [p.location for p in model.parameters()] == ["w0", "w0", "w1", "w1", "w2", "w2"]


def test_effort_zero_is_list_scheduling_only_and_still_no_worse_than_naive():
    b = random_dag(200, 7)
    cost = CostModel.local()
    quick = place(b.nodes, b.values, WORKERS, cost, effort=0)
    full = place(b.nodes, b.values, WORKERS, cost)
    naive = naive_placement(b.nodes, b.values)
    t_quick, t_full = (finish_time(b.nodes, b.values, p, cost) for p in (quick, full))
    assert t_full <= t_quick <= finish_time(b.nodes, b.values, naive, cost)
