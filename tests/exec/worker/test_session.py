"""Running cached programs (session.py): call steps prepared once, the same values as plain
torch, and every check of a run kept: undo on failure, the memory limit per step. And the
inbox: a transfer is kept with the identity that sent it.

Programs are hand-made and sent by a second peer on a local grid's bus (`Peer`).
"""

from __future__ import annotations

import threading

import pytest
import torch

import gridgraph as gg
from gridgraph.exec.safety.budget import MemoryBudget
from gridgraph.exec.safety.limits import Limits
from gridgraph.exec.worker import prepare, session, worker
from gridgraph.schedule.program import Call, Param, Slot
from tests.exec import hostile
from tests.exec.local_peer import Peer


def _run(plan: int, run: int, slots: list[int], params: list, program: list | None) -> dict:
    msg = {"kind": "run", "run": run, "plan": plan, "slots": slots, "params": params}
    return msg if program is None else {**msg, "program": program}


# x*x + p, then cat([x, that]) with a keyword, then a sum over a dimension list: slots,
# a parameter, a tensor list and constant lists as arguments.
PROGRAM = [[
    ["call", "aten::mul.Tensor", [Slot(0), Slot(0)], {}, [1], [], False],
    ["call", "aten::add.Tensor", [Slot(1), Param(0)], {"alpha": 2}, [2], [], False],
    ["call", "aten::cat.default", [[Slot(0), Slot(2)]], {"dim": 0}, [3], [], False],
    ["call", "aten::sum.dim_IntList", [Slot(3), [0]], {"keepdim": True}, [4], [], False],
    ["return", 3],
    ["return", 4],
]]  # fmt: skip


def _expected(x: torch.Tensor, p: float) -> tuple[torch.Tensor, torch.Tensor]:
    both = torch.cat([x, torch.add(x * x, p, alpha=2)], dim=0)
    return both, both.sum([0], keepdim=True)


def test_a_cached_program_replays_with_its_ops_resolved_once(local_grid, monkeypatch):
    peer = Peer(local_grid)
    x = torch.randn(3, 2)
    assert peer.request("w0", {"kind": "put", "values": [[1, x]]})["ok"]
    first = peer.request("w0", _run(7, 1, [1, 2, 3, 4, 5], [[0, 0.5]], PROGRAM))
    assert first["ok"], first

    def no_lookup(name: str) -> None:
        raise AssertionError(f"{name} looked up again during a replay")

    monkeypatch.setattr(prepare, "resolve", no_lookup)
    for run, p in ((2, -1.5), (3, 4.0)):  # new floats, the cached program
        reply = peer.request("w0", _run(7, run, [1, 12, 13, 14, 15], [[0, p]], None))
        assert reply["ok"], reply
        [[_, both], [_, total]] = reply["returns"]
        want_both, want_total = _expected(x, p)
        assert torch.equal(both, want_both) and torch.equal(total, want_total)


def test_a_cached_program_failing_midway_undoes_what_it_stored_and_names_the_op(local_grid):
    peer = Peer(local_grid)
    values = [[1, torch.ones(2, 3)], [4, torch.tensor([5])]]
    assert peer.request("w0", {"kind": "put", "values": values})["ok"]
    # row 5 of 2: the kernel refuses it when it runs (its meta kernel cannot tell)
    program = [[
        ["call", "aten::add.Tensor", [Slot(0), 1.0], {}, [2], [], False],
        ["call", "aten::index_select.default", [Slot(2), 0, Slot(1)], {}, [3], [], False],
        ["return", 3],
    ]]  # fmt: skip
    fetch = _run(9, 9, [2], [], [[["return", 0]]])
    for run, sent in ((1, program), (2, None)):  # sent with the program, then cached
        reply = peer.request("w0", _run(8, run, [1, 4, 2, 3], [], sent))
        assert not reply["ok"] and reply["error"]["op"] == "aten::index_select.default"
        with pytest.raises(IndexError) as plain:
            torch.index_select(torch.ones(2, 3), 0, torch.tensor([5]))
        assert str(plain.value) in reply["error"]["message"]
        gone = peer.request("w0", {**fetch, "run": 10 + run})
        assert not gone["ok"] and "not stored" in gone["error"]["message"]  # undone
    ok = peer.request("w0", _run(9, 20, [1], [], [[["return", 0]]]))
    assert torch.equal(ok["returns"][0][1], torch.ones(2, 3))  # its input untouched


def test_the_memory_limit_holds_at_every_step_of_a_cached_program():
    # nonzero has no meta kernel: its output is bounded from its input's data as it runs
    program = [[
        ["call", "aten::nonzero.default", [Slot(0)], {}, [1], [], False],
        ["call", "aten::nonzero.default", [Slot(0)], {}, [2], [], False],
        ["call", "aten::nonzero.default", [Slot(0)], {}, [3], [], False],
    ]]  # fmt: skip
    with gg.local_grid(1, limits=Limits(max_client_memory=1 << 20)) as grid:
        peer = Peer(grid)
        small = torch.ones(1 << 13)  # 32 KiB; each nonzero makes 64 KiB
        assert peer.request("w0", {"kind": "put", "values": [[1, small]]})["ok"]
        assert peer.request("w0", _run(1, 1, [1, 2, 3, 4], [], program))["ok"]  # 224 KiB
        state = grid.local_workers[0].sessions["mallory/s"]
        held = state.work.store.stored_bytes
        x = torch.ones(1 << 15)  # 128 KiB; each nonzero makes 256 KiB: the third is over
        assert peer.request("w0", {"kind": "put", "values": [[5, x]]})["ok"]
        reply = peer.request("w0", _run(1, 2, [5, 6, 7, 8], [], None))  # the cached program
        assert not reply["ok"] and "memory limit" in reply["error"]["message"]
        assert reply["error"]["op"] == "aten::nonzero.default"
        assert state.work.ops_run == 3 + 2  # refused at the step that would go over
        assert state.work.store.stored_bytes == held + x.nbytes  # the run's results undone


def test_a_sessions_requests_are_served_by_one_lasting_thread(local_grid, monkeypatch):
    # torch's intra-op thread pool belongs to the calling thread: a new serving thread per
    # request would start a cold pool every training step.
    threads: list[threading.Thread] = []
    answer = worker.answer

    def record_thread(*args):
        threads.append(threading.current_thread())
        return answer(*args)

    monkeypatch.setattr(worker, "answer", record_thread)
    peer = Peer(local_grid)
    for _ in range(5):
        assert peer.request("w0", {"kind": "ping"})["ok"]
    assert len(threads) == 5 and all(t is threads[0] for t in threads)


def test_an_idle_serving_thread_ends_and_the_session_is_idle_while_it_waits(monkeypatch):
    monkeypatch.setattr(worker, "SERVER_LINGER", 0.05)
    with gg.local_grid(1) as grid:
        peer = Peer(grid)
        assert peer.request("w0", {"kind": "ping"})["ok"]
        state = grid.local_workers[0].sessions["mallory/s"]
        assert not state.busy  # evictable and expirable while its thread waits for more
        for _ in range(200):
            with state.cv:
                if not state.serving:
                    break
            threading.Event().wait(0.01)
        assert not state.serving
        assert peer.request("w0", {"kind": "ping"})["ok"]  # a new thread serves it


def test_a_session_keeps_replies_until_acknowledged_and_counts_their_bytes(monkeypatch):
    # It kept the 16 latest replies, by count: with more requests in flight, one reply lost
    # on the way turned a request that ran into "already served; reply no longer kept".
    monkeypatch.setattr(session, "RECORDS_KEPT", 400)
    state = session.Session("peer/s", "peer")
    for i in range(1, 101):
        state.replied(state.record(f"{i:x}"), bytes(i))
    assert all(rec.reply is not None for rec in state.records.values())  # none acknowledged
    assert state.memory() == sum(range(1, 101)) + session.RECORD_BYTES * 100
    state.acknowledge({"below": 51, "ids": [60, 70]})
    kept = [int(rid, 16) for rid, rec in state.records.items() if rec.reply is not None]
    assert kept == [i for i in range(51, 101) if i not in (60, 70)]
    assert len(state.records) == 50  # under the watermark: no record, refused as stale
    assert state.stale("32") and not state.stale("3c") and not state.stale("65")
    assert state.records["3c"].dropped == session.ACKNOWLEDGED  # its bare id stays
    assert state.memory() == sum(kept) + session.RECORD_BYTES * 50


def test_unacknowledged_replies_are_bounded_by_bytes_the_latest_always_kept(monkeypatch):
    monkeypatch.setattr(session, "REPLY_BYTES_KEPT", 1000)
    state = session.Session("peer/s", "peer")
    for i in range(1, 21):
        state.replied(state.record(f"{i:x}"), bytes(100))
    kept = [rid for rid, rec in state.records.items() if rec.reply is not None]
    assert kept == [f"{i:x}" for i in range(11, 21)]
    assert state.records["1"].dropped == session.OVER_BYTES
    state.replied(state.record("15"), bytes(5000))  # over the bound alone: still kept
    assert [rid for rid, rec in state.records.items() if rec.reply is not None] == ["15"]
    assert state.memory() == 5000 + session.RECORD_BYTES * 21


def test_kept_replies_are_charged_and_one_the_budget_cannot_take_is_kept_uncharged():
    state = session.Session("peer/s", "peer")
    held = [0]  # what the peer's budget holds: its records (charged as the worker does)

    def charge(nbytes: int) -> bool:
        if replies() + nbytes > 250:  # the replies' room in the peer's share
            return False
        held[0] += nbytes
        return True

    def replies() -> int:
        return held[0] - session.RECORD_BYTES * len(state.records)

    def reply(rid: str, size: int) -> None:
        held[0] += session.RECORD_BYTES
        state.replied(state.record(rid), bytes(size))

    state.charge, state.release = charge, lambda nbytes: held.__setitem__(0, held[0] - nbytes)
    for i in range(1, 6):
        reply(f"{i:x}", 100)
    kept = [rid for rid, rec in state.records.items() if rec.reply is not None]
    assert kept == ["4", "5"] and replies() == 200  # the oldest went for the newest
    assert state.records["1"].dropped == session.OVER_BUDGET
    reply("6", 400)  # over the share alone: kept (exactly once needs it), uncharged
    rec = state.records["6"]
    assert rec.reply is not None and not rec.charged and replies() == 0
    reply("7", 50)
    assert state.records["7"].charged and replies() == 50
    state.acknowledge({"below": 7})  # releases what was charged, never what was not
    assert replies() == 50 and len(state.records) == 1
    state.close()
    assert held[0] == 0


def test_a_malformed_acknowledgement_is_ignored():
    state = session.Session("peer/s", "peer")
    state.replied(state.record("1"), b"x")
    for ack in [None, 5, {"below": "9"}, {"below": 2**70}, {"ids": [1] * 65}, {"ids": "1"},
                {"below": 1.5e9}, {"ids": [-1, 2**70, "1"]}]:  # fmt: skip
        state.acknowledge(ack)
    assert state.records["1"].reply == b"x" and state.acked_below == 0


def test_steps_after_a_transfer_are_checked_each_run_from_remembered_footprints(monkeypatch):
    # w0's mul reads what w1 sends, so its footprint is known only when the tensor comes:
    # worked out on meta once per argument layout, then remembered, and still checked.
    meta_runs = []
    footprint = prepare.op_footprint
    monkeypatch.setattr(prepare, "op_footprint", lambda *a: meta_runs.append(1) or footprint(*a))
    square = [["recv", [0], "w1"], hostile.call("aten::mul.Tensor", [Slot(0), Slot(0)], [1]),
              ["return", 1]]  # fmt: skip
    with gg.local_grid(2, limits=Limits(max_client_memory=1 << 20)) as grid:
        peer = Peer(grid)
        small, big = torch.randn(16), torch.randn(150_000)  # 600 kB: its square is over
        put = {"kind": "put", "values": [[1, small], [2, big]]}
        assert peer.request("w1", put)["ok"]
        state = grid.local_workers[0].sessions

        def square_on_w0(run: int, vid: int, program: bool) -> dict:
            rid = peer.send("w0", hostile.run(square, [vid, 100 + run], run_id=run, plan=1,
                                              program=program, peers={"w1": "w1"}))  # fmt: skip
            sent = hostile.run([["send", [0], "w0"]], [vid], run_id=run, plan=2, program=program,
                               peers={"w0": "w0"})  # fmt: skip
            peer.send("w1", sent)
            return peer.reply(rid)

        for run in range(1, 4):
            reply = square_on_w0(run, 1, program=run == 1)
            assert reply["ok"], reply
            assert torch.equal(reply["returns"][0][1], small * small)
        assert len(meta_runs) == 1  # the same layout each time: one meta run
        ops_run = state["mallory/s"].work.ops_run
        reply = square_on_w0(4, 2, program=False)
        assert not reply["ok"] and "memory limit" in reply["error"]["message"], reply
        assert reply["error"]["op"] == "aten::mul.Tensor"
        assert state["mallory/s"].work.ops_run == ops_run  # refused before it ran
        assert len(meta_runs) == 2  # a new layout: worked out anew


def test_a_call_keeps_the_footprints_it_used_last_not_the_first_it_met(monkeypatch):
    # A step that sees one layout every other run, and others in between, keeps that one.
    meta_runs = []
    footprint = prepare.op_footprint
    monkeypatch.setattr(prepare, "op_footprint", lambda *a: meta_runs.append(1) or footprint(*a))
    call = prepare.CompiledCall(Call("aten::mul.Tensor", [Slot(0), Slot(0)], {}, [1], [], False))
    usual = torch.randn(4)
    others = [torch.randn(5 + i) for i in range(prepare.FOOTPRINTS_KEPT)]

    def check(x: torch.Tensor) -> tuple:
        return call.footprint([x, x], {})

    first = check(usual)
    for x in others[:-1]:  # the cache is full now
        check(x)
    assert check(usual) == first  # remembered: used again now
    check(others[-1])  # one more layout: the one used longest ago goes, not `usual`
    runs = len(meta_runs)
    assert check(usual) == first
    assert len(meta_runs) == runs  # no meta run: still remembered
    assert meta_runs and runs == prepare.FOOTPRINTS_KEPT + 1


def test_a_transfer_from_another_sender_does_not_take_the_place_of_the_real_one():
    state = session.Session("alice/s", "alice")
    key = (1, 11, "w1")  # run 1, value 11, from worker w1
    forged, real = b"a forged transfer", b"the real transfer"  # as received
    state.deliver(key, "mallory", forged)  # first, under the same key
    state.deliver(key, "box-1", real)  # w1's identity, as its run names
    with state.cv:
        assert state.has_transfer(key, "box-1") and not state.has_transfer(key, "carol")
        assert state.take(key, "box-1") == real
    assert state.memory() == 0  # the forgery went with it
    state.deliver(key, "box-1", real)  # a resent copy: used already
    state.deliver(key, "mallory", forged)
    assert state.memory() == 0


def test_a_sent_transfer_over_its_peers_share_drops_none_of_those_kept():
    """One larger than the whole share cannot be kept however many older ones go: they stay
    (a resend still needs them)."""
    budget = MemoryBudget(4000, shares=1)
    kept = session.Session("mallory/s", "mallory")
    kept.charge = lambda n: budget.charge("mallory", n)
    kept.release = lambda n: budget.release("mallory", n)
    kept.fits = lambda n: budget.fits("mallory", n)
    kept.keep_sent((1, 1, "w1"), "w1-id", b"a" * 1000)
    kept.keep_sent((2, 1, "w1"), "w1-id", b"b" * 1000)
    kept.keep_sent((3, 1, "w1"), "w1-id", b"c" * 5000)  # over the 4000-byte share alone
    assert list(kept.sent) == [(1, 1, "w1"), (2, 1, "w1")]
    assert budget.held("mallory") == 2000
    kept.keep_sent((4, 1, "w1"), "w1-id", b"d" * 3000)  # fits once the oldest goes
    assert list(kept.sent) == [(2, 1, "w1"), (4, 1, "w1")] and budget.held() == 4000
