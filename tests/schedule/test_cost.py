"""The cost model: FLOPs per op, transfer times, and the finish-time simulation."""

from __future__ import annotations

import pytest
import torch

from gridgraph.schedule.cost import CostModel, bytes_moved, estimate_flops, finish_time
from gridgraph.schedule.place import naive_placement, place
from gridgraph.schedule.plan import split
from tests.schedule.graphs import WORKERS, Builder, random_dag

aten = torch.ops.aten
# Round numbers: 1 GFLOP/s, 1 MB/s, 1 ms per message.
SIMPLE = CostModel(flops=1e9, bandwidth=1e6, latency=1e-3)


def test_presets_and_links():
    local, pubsub = CostModel.local(), CostModel.pubsub()
    assert pubsub.latency >= 10 * local.latency and pubsub.bandwidth < local.bandwidth
    assert local.shared and not pubsub.shared  # in-process workers share one machine

    assert pubsub.transfer_time(1_000_000, "w0", "w1") == pytest.approx(0.02)
    for preset in (CostModel.local, CostModel.pubsub):  # a preset's own numbers can be changed
        assert preset(latency=1.0, bandwidth=2.0).transfer_time(4, "w0", "w1") == 3.0
    slow = CostModel(worker_flops={"w1": 1e9}, links={("w0", "w1"): (1e3, 0.5)})
    assert slow.compute_time(1e9, "w1") == 1.0 and slow.compute_time(5e10, "w0") == 1.0
    assert slow.transfer_time(1000, "w0", "w1") == 1.5  # that link only, one way
    assert slow.transfer_time(1000, "w1", "w0") == pytest.approx(50e-6 + 1000 / 5e9)


def test_shared_machine_adds_up_every_op_and_transfer():
    b = Builder()
    x = b.stored((1000,), "w0")
    u = b(aten.relu.default, x)  # 1 us each on a 1 GFLOP/s worker
    v = b(aten.relu.default, b.stored((1000,), "w1"))
    b(aten.add.Tensor, u, v)
    placement = dict(zip((n.id for n in b.nodes), ["w0", "w1", "w0"]))
    apart = CostModel(flops=1e9, bandwidth=1e6, latency=1e-3)
    shared = CostModel(flops=1e9, bandwidth=1e6, latency=1e-3, shared=True)
    # apart: relu and relu in parallel, then v's 4 KB copy (1 ms + 4 ms), then the add
    assert finish_time(b.nodes, b.values, placement, apart) == pytest.approx(1e-6 + 5e-3 + 1e-6)
    # shared: one after another
    assert finish_time(b.nodes, b.values, placement, shared) == pytest.approx(3e-6 + 5e-3)


def test_flops_of_matmuls_convolutions_views_and_elementwise():
    b = Builder()
    x, w = b.stored((64, 32), "w0"), b.stored((32, 8), "w1")
    bias = b.stored((8,), "w1")
    mm = b(aten.mm.default, x, w)
    addmm = b(aten.addmm.default, bias, x, w)
    t = b(aten.t.default, w)
    relu = b(aten.relu.default, x)
    img, k = b.stored((2, 3, 16, 16), "w0"), b.stored((4, 3, 3, 3), "w0")
    conv = b(aten.convolution.default, img, k, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    grad = b.stored((2, 4, 16, 16), "w0")
    back = b(
        aten.convolution_backward.default,
        grad, img, k, [4], [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [True, True, False],
    )  # fmt: skip
    f = {n.outputs[0]: estimate_flops(n, b.values) for n in b.nodes}
    assert f[mm.value] == 2 * 64 * 8 * 32
    assert f[addmm.value] == 2 * 64 * 8 * 32 + 64 * 8
    assert f[t.value] == 0  # a view moves no data
    assert f[relu.value] == 64 * 32
    conv_flops = 2 * (2 * 4 * 16 * 16) * 3 * 9  # output points * in-channels * kernel
    assert f[conv.value] == conv_flops
    assert f[back[0].value] == 2 * conv_flops  # grad input and grad weight, no grad bias


def test_finish_time_by_hand():
    b = Builder()
    x = b.stored((250, 1000), "w0")  # 1 MB
    w = b.stored((1000, 250), "w1")  # 1 MB
    h = b(aten.mm.default, x, w)  # 250 KB; 2 * 250 * 250 * 1000 = 125 MFLOP: 0.125 s
    b(aten.relu.default, h)  # 62,500 FLOPs
    mm, relu = (n.id for n in b.nodes)
    local = finish_time(b.nodes, b.values, {mm: "w0", relu: "w0"}, SIMPLE)
    assert local == pytest.approx(1.001 + 0.125 + 62_500e-9)  # w arrives after 1 ms + 1 s
    split_ = finish_time(b.nodes, b.values, {mm: "w0", relu: "w2"}, SIMPLE)
    assert split_ == pytest.approx(1.001 + 0.125 + 0.251 + 62_500e-9)  # h moves too
    assert bytes_moved(b.nodes, b.values, {mm: "w0", relu: "w2"}) == 1_250_000


def test_a_value_is_sent_once_per_destination():
    b = Builder()
    x = b.stored((1000,), "w0")
    for _ in range(3):
        b(aten.relu.default, x)
    on_w1 = {n.id: "w1" for n in b.nodes}
    assert bytes_moved(b.nodes, b.values, on_w1) == 4000
    t = finish_time(b.nodes, b.values, on_w1, SIMPLE)
    assert t == pytest.approx(1e-3 + 4000 / 1e6 + 3 * 1000e-9)  # one transfer, three relus
    spread = {n.id: w for n, w in zip(b.nodes, WORKERS)}  # w0 needs none, w1 and w2 one each
    assert bytes_moved(b.nodes, b.values, spread) == 8000


def test_workers_run_their_ops_in_recording_order():
    b = Builder()
    x = b.stored((1000, 1000), "w0")
    for _ in range(2):
        b(aten.relu.default, x)  # 1 MFLOP: 1 ms each, independent, both on w0
    t = finish_time(b.nodes, b.values, {n.id: "w0" for n in b.nodes}, SIMPLE)
    assert t == pytest.approx(2e-3)


@pytest.mark.parametrize("seed", [0, 1])
def test_bytes_moved_matches_the_split_plan(seed):
    b = random_dag(60, seed, d=32)
    for placement in (naive_placement(b.nodes, b.values), place(b.nodes, b.values, WORKERS)):
        plan = split(b.nodes, placement, b.values, keep=set())
        assert bytes_moved(b.nodes, b.values, placement) == plan.bytes_moved


def test_values_leave_as_soon_as_they_are_ready_as_split_sends_them():
    """The model sends a value when it is ready, not after unrelated ops; so does split."""
    b = Builder()
    x = b.stored((1000,), "w0")
    v = b(aten.relu.default, x)  # 1 us
    b(aten.relu.default, b.stored((1000, 1000), "w0"))  # 1 ms, unrelated, recorded before
    b(aten.relu.default, v)  # on w1: needs v (4 KB: 1 ms + 4 ms)
    placement = dict(zip((n.id for n in b.nodes), ["w0", "w0", "w1"]))
    assert finish_time(b.nodes, b.values, placement, SIMPLE) == pytest.approx(1e-6 + 5e-3 + 1e-6)
    plan = split(b.nodes, placement, b.values, keep=set())
    kinds = [step.kind for stage in plan.programs["w0"] for step in stage if step.kind != "free"]
    assert kinds == ["call", "send", "call"]  # the send does not wait for the unrelated op
