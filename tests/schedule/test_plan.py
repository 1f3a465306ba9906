"""plan.split's coalesced transfers: what travels together, when it is sent, and that the
values a receiver sees are what torch gives (see plan.py's docstring for the rules)."""

from __future__ import annotations

import copy

import pytest
import torch

import gridgraph as gg
from gridgraph.schedule.cost import CostModel, Timeline
from gridgraph.schedule.place import naive_placement, place
from gridgraph.schedule.plan import split
from gridgraph.schedule.program import Free, Send
from tests.schedule.graphs import WORKERS, Builder, random_dag

aten = torch.ops.aten


def sends(plan, worker: str) -> list[Send]:
    return [step for stage in plan.programs[worker] for step in stage if type(step) is Send]


def test_two_values_from_one_worker_in_one_stage_travel_in_one_message():
    b = Builder()
    x, y = b.stored((8, 8), "w0"), b.stored((8, 8), "w0")
    b(aten.mm.default, x, y, pin="w1")
    plan = split(b.nodes, naive_placement(b.nodes, b.values), b.values, keep=set())
    assert len(plan.transfers) == 2 and plan.messages == 1
    [send] = sends(plan, "w0")
    assert [plan.slots[s] for s in send.slots] == [x.value, y.value] and send.worker == "w1"
    assert "send %0, %1 -> w1" in str(plan) and "recv %0, %1 <- w0" in str(plan)


def test_a_value_made_after_the_first_reader_by_real_work_opens_a_new_message():
    b = Builder()
    x = b.stored((8, 8), "w0")
    b(aten.relu.default, x, pin="w1")  # the first reader: x travels
    v = b(aten.neg.default, x)  # on w0, recorded after that reader
    b(aten.relu.default, v, pin="w1")
    plan = split(b.nodes, naive_placement(b.nodes, b.values), b.values, keep=set())
    assert plan.messages == 2
    # the first message does not wait for neg: it goes before it
    kinds = [s.kind for stage in plan.programs["w0"] for s in stage if s.kind != "free"]
    assert kinds == ["send", "call", "send"]


def test_a_later_view_of_a_value_sent_joins_its_message():
    b = Builder()
    w = b.stored((8, 4), "w0")
    x = b.stored((2, 8), "w1")
    b(aten.mm.default, x, w, pin="w1")  # the first reader of w
    wt = b(aten.t.default, w)  # a view, on w0 with its base, recorded later
    b(aten.mm.default, wt, b.stored((8, 3), "w1"), pin="w1")
    plan = split(b.nodes, naive_placement(b.nodes, b.values), b.values, keep=set())
    assert len(plan.transfers) == 2 and plan.messages == 1
    kinds = [s.kind for stage in plan.programs["w0"] for s in stage if s.kind != "free"]
    assert kinds == ["call", "call", "send", "call"]  # t, then the one send (with swaps)


def test_a_write_between_keeps_a_later_view_out_of_the_message():
    b = Builder()
    w = b.stored((8, 4), "w0")
    x = b.stored((2, 8), "w1")
    b(aten.mm.default, x, w, pin="w1")
    b(aten.add_.Tensor, w, 1.0)  # a write on w0: the message must not wait past it
    wt = b(aten.t.default, w)
    b(aten.mm.default, wt, b.stored((8, 3), "w1"), pin="w1")
    plan = split(b.nodes, naive_placement(b.nodes, b.values), b.values, keep=set())
    assert plan.messages == 2
    steps = [s for stage in plan.programs["w0"] for s in stage if type(s) is not Free]
    assert type(steps[0]) is Send and steps[1].op == "aten::add_.Tensor"


def test_the_longest_chain_of_hops_starts_first():
    # w flows w1 -> w2 -> (gradient) -> w0, and w1 -> w0: w1 heads a chain of three hops.
    b = Builder()
    w = b.stored((8, 1), "w1")
    y0 = b(aten.mm.default, b.stored((4, 8), "w0"), w, pin="w0")  # w0 reads w first
    g2 = b(aten.mm.default, b.stored((4, 8), "w2"), w, pin="w2")
    b(aten.add.Tensor, y0, g2, pin="w0")
    plan = split(b.nodes, naive_placement(b.nodes, b.values), b.values, keep=set())
    # the client publishes run messages in this order, and w1 its sends in theirs
    assert list(plan.programs) == ["w1", "w2", "w0"]
    assert [send.worker for send in sends(plan, "w1")] == ["w2", "w0"]


@pytest.mark.parametrize("seed", range(4))
def test_the_cost_model_opens_the_messages_split_sends(seed):
    b = random_dag(60, seed, d=32)
    for cost in (CostModel.local(), CostModel.pubsub()):
        for placement in (
            naive_placement(b.nodes, b.values),
            place(b.nodes, b.values, WORKERS, cost),
        ):
            tl = Timeline(b.nodes, b.values, WORKERS, cost)
            plan = split(b.nodes, placement, b.values, keep=set())
            assert tl.messages(tl.encode(placement)) == plan.messages


# --- on a grid: what the receiver sees ----------------------------------------------------------


def test_a_grouped_transfer_is_one_message_and_gives_torchs_values(local_grid):
    w0, w1, _ = local_grid.workers
    a, c = torch.randn(16, 8), torch.randn(16, 8)
    pa, pc = a.send(w0), c.send(w0)
    local_grid.reset_stats()
    with gg.trace():
        with gg.on(w1):
            z = pa * pc + pa
    assert torch.equal(z.get(), a * c + a)
    plan = local_grid.client.last_plan
    assert len(plan.transfers) == 2 and plan.messages == 1
    # runs and replies: w0 (sends) and w1 (computes, returns); the get rides on w1's run
    assert local_grid.stats()["messages"] == 2 * len(plan.programs) + 1


def test_an_in_place_write_after_a_grouped_send_does_not_leak(local_grid):
    """The group {a, b} goes before the write to b; sent after it, r2 would see b + 1."""
    w0, w1, _ = local_grid.workers
    a, b = torch.randn(8), torch.randn(8)
    pa, pb = a.send(w0), b.send(w0)
    with gg.trace():
        with gg.on(w1):
            r1 = pa * 2  # opens the message w0 -> w1
            r2 = pb * 3  # joins it (stored before the first reader)
        pb.add_(1)  # on w0, where b lives, recorded after both readers
        with gg.on(w1):
            r3 = pb * 1  # sees the write: another message
    r1, r2, r3 = gg.compute(r1, r2, r3)
    assert local_grid.client.last_plan.messages == 2
    assert torch.equal(r1.get(), a * 2)
    assert torch.equal(r2.get(), b * 3)
    assert torch.equal(r3.get(), b + 1)
    assert torch.equal(pb.get(), b + 1)


def test_a_write_to_a_weight_between_its_views_does_not_leak(local_grid):
    """W goes to w1 before W.add_; the later view of W (after the write) travels apart. Had
    the view joined W's message, W would have been sent after the write."""
    w0, w1, _ = local_grid.workers
    W, x = torch.randn(8, 4), torch.randn(2, 8)
    pW, px = W.send(w0), x.send(w1)
    with gg.trace():
        with gg.on(w1):
            y1 = px @ pW
        pW.add_(1)
        with gg.on(w1):
            y2 = px @ pW.t().t()
    y1, y2 = gg.compute(y1, y2)
    torch.testing.assert_close(y1.get(), x @ W)
    torch.testing.assert_close(y2.get(), x @ (W + 1))


def test_the_demo_mlp_step_sends_fewer_messages_than_transfers_and_trains_as_torch(local_grid):
    """gridgraph/demo.py's model, layers on three workers, Adam: every replayed step sends
    one message per worker pair and stage, fewer than its transfers, and the parameters
    follow plain torch's."""
    torch.manual_seed(0)
    X = torch.randn(256, 16)
    Y = (X[:, :4].sum(1) > 0).long()
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                                torch.nn.ReLU(), torch.nn.Linear(64, 2))  # fmt: skip
    local = copy.deepcopy(model)
    w0, w1, w2 = local_grid.workers
    for module, w in zip(model[::2], (w0, w1, w2)):
        module.send(w)
    x, y = X.send(w0), Y.send(w2)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    local_opt = torch.optim.Adam(local.parameters(), lr=0.01)
    for _ in range(4):
        local_grid.reset_stats()
        with gg.trace():
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
        gg.compute(loss, *model.parameters())
        plan = local_grid.client.last_plan
        assert plan.messages < len(plan.transfers)
        assert local_grid.stats()["messages"] == 2 * len(plan.programs) + plan.messages
        local_opt.zero_grad()
        torch.nn.functional.cross_entropy(local(X), Y).backward()
        local_opt.step()
    for p, q in zip(model.parameters(), local.parameters()):
        torch.testing.assert_close(p.get(), q.detach())


@pytest.mark.parametrize("seed", range(3))
def test_the_fewest_bytes_program_finds_what_brute_force_finds(seed):
    """exact.fewest_bytes (the ILP bench_transfers.py measures against) on graphs small
    enough to try every placement; skipped where scipy (the `bench` extra) is missing."""
    pytest.importorskip("scipy")
    from gridgraph.schedule.cost import bytes_moved
    from gridgraph.schedule.exact import exact_placement, fewest_bytes

    b = random_dag(10, 100 + seed, d=[64, 256, 512][seed])
    brute, _ = exact_placement(b.nodes, b.values, WORKERS, objective="bytes")
    placement, least = fewest_bytes(b.nodes, b.values, WORKERS)
    assert least == bytes_moved(b.nodes, b.values, placement)
    assert least == bytes_moved(b.nodes, b.values, brute)
