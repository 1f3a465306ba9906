"""The worker's per-session state and exactly-once serving, from a second peer on the bus.

Each test drives a live `gg.local_grid` worker with hand-made requests from an endpoint of
its own (`Peer`), beside the grid's ordinary client, and checks values against plain torch.
Transfers between workers: a run names the identity of each worker it sends to or receives
from (`peers`), and a worker takes a transfer only from that identity.
"""

from __future__ import annotations

import threading
import time
import uuid

import pytest
import torch

import gridgraph as gg
from gridgraph.exec import wire
from gridgraph.exec.client.client import Client
from gridgraph.exec.grid import Grid
from gridgraph.exec.isolation import executor
from gridgraph.exec.transport import LocalBus
from gridgraph.exec.worker.worker import Worker
from gridgraph.schedule.program import Slot
from tests.exec import hostile
from tests.exec.local_peer import Peer, add_one_in_place, second_client

# --- exactly once ----------------------------------------------------------------------------


def test_a_request_id_runs_once_per_session_whatever_other_peers_send(local_grid):
    victim, attacker = Peer(local_grid, "victim"), Peer(local_grid, "attacker")
    x = torch.arange(4.0)
    assert victim.request("w0", {"kind": "put", "values": [[1, x]]})["ok"]
    rid = uuid.uuid4().hex
    assert victim.request("w0", add_one_in_place(1), rid)["ok"]
    for _ in range(300):  # a shared 256-entry reply cache forgot the victim's reply here
        assert attacker.request("w0", {"kind": "ping"})["ok"]
    again = victim.request("w0", add_one_in_place(1), rid)  # the victim's resend
    assert again["ok"]
    fetch = {"kind": "run", "run": 2, "plan": 2, "program": [[["return", 0]]], "slots": [2],
             "params": []}  # fmt: skip
    [[_, value]] = victim.request("w0", fetch)["returns"]
    assert torch.equal(value, x + 1)  # added once


def test_resends_while_the_request_is_queued_or_running_do_not_run_it_again(local_grid):
    peer = Peer(local_grid)
    assert peer.request("w0", {"kind": "put", "values": [[1, torch.zeros(3)]]})["ok"]
    rid = peer.send("w0", add_one_in_place(1))
    for _ in range(5):
        peer.send("w0", add_one_in_place(1), rid)
    first = peer.reply(rid)
    assert first["ok"]
    # A copy that came after the reply went out is answered again (its reply may have been
    # lost), with the same reply; none runs the request again.
    while not peer.no_reply_within(0.5):
        pass
    fetch = {"kind": "run", "run": 2, "plan": 2, "program": [[["return", 0]]], "slots": [2],
             "params": []}  # fmt: skip
    assert torch.equal(peer.request("w0", fetch)["returns"][0][1], torch.ones(3))


def test_a_reply_that_cannot_be_encoded_is_an_error_reply_and_is_not_run_again(local_grid):
    peer = Peer(local_grid)
    halves = torch.ones(3, 2, dtype=torch.half)
    assert peer.request("w0", {"kind": "put", "values": [[1, halves]]})["ok"]
    to_chalf = ["call", "aten::view_as_complex.default", [Slot(0)], {}, [1], [], False]
    msg = {"kind": "run", "run": 1, "plan": 1, "program": [[to_chalf, ["return", 1]]],
           "slots": [1, 2], "params": []}  # fmt: skip
    rid = uuid.uuid4().hex
    reply = peer.request("w0", msg, rid)  # torch.complex32 is not a wire dtype
    assert not reply["ok"] and "could not be encoded" in reply["error"]["message"]
    worker = local_grid.local_workers[0]
    ops = worker.sessions[f"mallory/{peer.session}"].work.ops_run
    assert peer.request("w0", msg, rid) == reply  # the resend is answered, not run
    assert worker.sessions[f"mallory/{peer.session}"].work.ops_run == ops


def test_a_request_whose_serving_fails_unexpectedly_gets_an_error_reply(local_grid, monkeypatch):
    # A bug while serving was logged, and the request got no reply: its client waited for
    # its whole timeout (a review: an executor's close raising in a bye).
    peer = Peer(local_grid)
    worker = local_grid.local_workers[0]
    serve = Worker._serve

    def broken(self, session, msg, payload):
        if msg["kind"] == "stats":
            raise RuntimeError("an injected bug")
        return serve(self, session, msg, payload)

    monkeypatch.setattr(Worker, "_serve", broken)
    reply = peer.request("w0", {"kind": "stats"}, timeout=10)
    assert not reply["ok"] and "an injected bug" in reply["error"]["message"]
    assert peer.request("w0", {"kind": "ping"})["ok"]  # and the session goes on
    assert worker.sessions[f"mallory/{peer.session}"] is not None


def test_every_malformed_request_gets_one_error_reply(local_grid):
    peer = Peer(local_grid)
    bad = [
        {"kind": "nonsense"},
        {"kind": "run"},
        {"kind": "run", "run": 1, "plan": 1, "slots": ["x"], "params": []},
        {"kind": "run", "run": 1, "plan": 1, "slots": [], "params": [[0]]},
        {"kind": "run", "run": 1, "plan": 1, "slots": [1], "params": [], "program": "x"},
        {"kind": "run", "run": 1, "plan": 1, "slots": [1], "params": [],
         "program": [[["call", "aten::add.Tensor", [Slot(0)], {}, [0], [["x", "y"]], False]]]},
        {"kind": "run", "run": 1, "plan": 1, "slots": [1], "params": [],
         "program": [[["call", "aten::add.Tensor", [Slot(0)], {1: 2}, [0], [], False]]]},
        {"kind": "run", "run": 1, "plan": 9, "slots": [1], "params": []},
        {"kind": "put", "values": [[1, 2]]},
        {"kind": "put", "values": "x"},
        {"kind": "seed", "seed": "x"},
        {"kind": "ping", "free": "x"},
        {"kind": "ping", "free": [1.5]},
    ]  # fmt: skip
    for msg in bad:
        reply = peer.request("w0", msg, uuid.uuid4().hex)
        assert not reply["ok"] and reply["error"]["message"], msg
    assert peer.no_reply_within(0.3)
    assert peer.request("w0", {"kind": "ping"})["ok"]


def test_a_refused_request_changes_nothing_not_even_its_frees(local_grid):
    a = torch.randn(5)
    x = a.send(local_grid.workers[0])
    me = local_grid.client
    peer = hostile.Peer(me.transport, me.session)  # the client's own session and identity
    refused = {"kind": "run", "run": 99, "plan": 99, "slots": [x._vid], "params": [],
               "program": [[["bogus", 0]]], "free": [x._vid]}  # fmt: skip
    assert not peer.request("w0", refused)["ok"]
    assert not peer.request("w0", {"kind": "seed", "seed": None, "free": [x._vid]})["ok"]
    assert torch.equal(x.get(), a)


def test_frees_of_a_refused_request_go_out_again_with_the_next_one():
    limits = gg.Limits(max_client_memory=1 << 20)
    with gg.local_grid(1, limits=limits) as grid:
        w0 = grid.workers[0]
        keep, drop = torch.ones(1000).send(w0), torch.ones(1000).send(w0)
        del drop  # its release rides on the next request
        big = torch.ones(1).send(w0)
        with pytest.raises(gg.RemoteError, match="memory limit"), gg.trace():
            big.expand(1 << 20).contiguous().get()  # refused: frees nothing
        assert grid.stats()["workers"]["w0"]["objects"] == 2  # the next request freed it
        assert torch.equal(keep.get(), torch.ones(1000))


def test_a_call_cannot_store_a_non_tensor_and_the_worker_keeps_serving(local_grid):
    peer = Peer(local_grid)
    assert peer.request("w0", {"kind": "put", "values": [[1, torch.ones(2)]]})["ok"]
    writes_an_int = ["call", "aten::add.Scalar", [Slot(0), 5], {}, [1, 2], [[1, 2]], False]
    msg = {"kind": "run", "run": 1, "plan": 1, "program": [[writes_an_int]], "slots": [1, 2, 3],
           "params": []}  # fmt: skip
    reply = peer.request("w0", msg)
    assert not reply["ok"] and "not a tensor" in reply["error"]["message"]
    worker = local_grid.local_workers[0]
    worker.expire_clients(lease=3600)  # the lease check reads every session's memory
    assert len(worker.sessions[f"mallory/{peer.session}"].work.store) == 1
    x = torch.randn(3)
    assert torch.equal((x.send(local_grid.workers[0]) * 2).get(), x * 2)


# --- per-session state -----------------------------------------------------------------------


def test_another_peers_programs_do_not_evict_mine(local_grid):
    x = torch.randn(8)
    p = x.send(local_grid.workers[0])
    assert torch.equal((p * 3).get(), x * 3)  # the programs are on w0 now
    local_grid.reset_stats()
    assert torch.equal((p * 3).get(), x * 3)
    messages = local_grid.stats()["messages"]  # two runs, two replies, no program
    attacker = Peer(local_grid)
    for plan in range(200):
        ret = {"kind": "run", "run": plan, "plan": plan, "program": [[["free", 0]]],
               "slots": [1], "params": []}  # fmt: skip
        assert attacker.request("w0", ret)["ok"]
    local_grid.reset_stats()
    assert torch.equal((p * 3).get(), x * 3)
    assert local_grid.stats()["messages"] == messages == 4  # no program had to be resent


def test_manual_seed_affects_only_the_callers_random_stream(local_grid):
    other = second_client(local_grid)
    w0, o0 = local_grid.workers[0], other.workers[0]
    w0.manual_seed(7)
    x = torch.zeros(4).send(w0)
    first = torch.randn_like(x).get()
    o0.manual_seed(123)  # another client reseeds: mine carries on
    torch.randn_like(torch.zeros(4).send(o0)).get()
    second = torch.randn_like(x).get()
    torch.manual_seed(7)
    assert torch.equal(first, torch.randn(4)) and torch.equal(second, torch.randn(4))
    other.close()


def test_stats_are_per_client(local_grid):
    other = second_client(local_grid)
    mine = torch.ones(10).send(local_grid.workers[1])
    theirs = [torch.ones(100).send(other.workers[1]) for _ in range(3)]
    (mine + 1).compute()
    before = local_grid.stats()["workers"]["w1"]
    assert before["objects"] == 1 and before["stored_bytes"] == 40 and before["ops_run"] == 1
    other.reset_stats()  # resets only the other client's counters
    assert local_grid.stats()["workers"]["w1"] == before
    assert other.stats()["workers"]["w1"]["objects"] == len(theirs)
    other.close()


def test_bye_frees_everything_the_session_held(local_grid):
    other = second_client(local_grid)
    x = torch.randn(50).send(other.workers[2])
    (x * 2).get()
    worker = local_grid.local_workers[2]
    [session] = [s for k, s in worker.sessions.items() if k.startswith("bob/")]
    assert session.memory() > 0 and session.records and session.work.programs
    other.close()
    assert not [k for k in worker.sessions if k.startswith("bob/")]
    assert session.memory() == 0 and not session.records and not session.work.programs
    late = Peer(local_grid, "bob", other.client.session)  # late requests of that session
    fetch = {"kind": "run", "run": 9, "plan": 9, "program": [[["return", 0]]],
             "slots": [x._vid], "params": []}  # fmt: skip
    for request in (fetch, {"kind": "put", "values": [[7, torch.ones(1000)]]}):
        reply = late.request("w2", request)  # refused: they opened a new, empty session,
        error = reply["error"]  # which kept a put's tensors until its lease ran out
        assert error["code"] == "session-ended" and "bye" in error["message"], reply
        assert not [k for k in worker.sessions if k.startswith("bob/")]


def test_a_failed_run_tells_the_worker_waiting_for_its_grouped_send(local_grid):
    """w0 fails before its send of two values: w1, waiting for both in one recv, hears it
    (its recv would otherwise wait the 120 s recv timeout) and stores neither."""
    peer = Peer(local_grid)
    put = {"kind": "put", "values": [[1, torch.ones(2)], [2, torch.ones(3)]]}
    assert peer.request("w0", put)["ok"]
    recv = [["recv", [0, 1], "w0"], ["return", 0]]
    rid = peer.send("w1", hostile.run(recv, [1, 2], run_id=5, peers={"w0": "w0"}))
    fails = [hostile.call("aten::neg.default", [Slot(2)], [3]), ["send", [0, 1], "w1"]]
    peer.send("w0", hostile.run(fails, [1, 2, 9, 10], run_id=5, peers={"w1": "w1"}))  # %9: absent
    reply = peer.reply(rid)  # (the peer drops the replies it does not wait for: w0's)
    assert not reply["ok"] and reply["error"]["upstream"], reply
    assert "%1, %2 from w0" in reply["error"]["message"]
    assert peer.request("w1", {"kind": "stats"})["objects"] == 0


# --- transfers: only between the identities the client names ---------------------------------


@pytest.mark.parametrize("isolate", [False, True], ids=["in-process", "executor"])
def test_a_recv_takes_only_the_transfer_of_the_identity_the_client_names(isolate):
    """Worker w1's endpoint is `box-1`, as the client knows it. An impostor whose identity is
    the bare name `w1` (what w0 would assume on its own) sends w0 transfers "from w1" for the
    client's next runs before the client runs anything: w0 uses none of them, and they, under
    the same keys and earlier, do not keep it from taking box-1's."""
    bus = LocalBus()
    isolation = executor.Isolation() if isolate else None
    workers = [Worker("w0", bus.endpoint("w0"), isolation=isolation),
               Worker("w1", bus.endpoint("box-1"), isolation=isolation)]  # fmt: skip
    client = Client(bus.endpoint("alice"), ["w0", "w1"])
    with Grid(client, on_close=lambda: [w.close() for w in workers]) as grid:
        w0, w1 = grid.workers
        a = torch.randn(16)
        x = a.send(w1)
        impostor = hostile.Peer(bus.endpoint("w1"))
        for run_id in range(1, 10):
            forged = {"kind": "transfer", "client": f"alice/{client.session}", "run": run_id,
                      "src": "w1", "values": [x._vid],
                      "tensors": [torch.full((16,), 42.0)]}  # fmt: skip
            impostor.publish("w0", wire.encode(forged))
        with gg.trace(), gg.on(w0):
            z = x * 2
        assert torch.equal(z.get(), a * 2)
        assert torch.equal((z + x).get(), a * 3)


def test_a_run_must_name_the_identity_of_every_worker_it_sends_to_or_receives_from(local_grid):
    peer = Peer(local_grid)
    assert peer.request("w0", {"kind": "put", "values": [[1, torch.ones(2)]]})["ok"]
    sends = [["send", [0], "w1"]]
    unnamed = [None, {}, {"w2": "w2"}, {"w1": 5}, {"w1": ""}, "w1", [["w1", "w1"]]]
    for peers in unnamed:
        reply = peer.request("w0", hostile.run(sends, [1], peers=peers))
        assert not reply["ok"] and "peers" in reply["error"]["message"], (peers, reply)
    assert "mallory/s" not in local_grid.local_workers[1].sessions  # nothing was sent
    assert peer.request("w0", hostile.run(sends, [1], peers={"w1": "w1"}))["ok"]
    inbox = local_grid.local_workers[1].sessions["mallory/s"].inbox
    assert inbox  # the transfer waits there for a run of w1 to take it, charged to its sender
    assert local_grid.local_workers[1].budget.held("w0") > 0  # (no run there named w0 yet)
    again = hostile.run(sends, [1], run_id=2, program=False)  # the cached program, unnamed
    reply = peer.request("w0", again)
    assert not reply["ok"] and "peers" in reply["error"]["message"], reply


def test_closing_a_grid_waits_for_its_workers_serving_threads():
    # A serving thread that still ran (unwinding torch's thread-local state) while the
    # interpreter exited could abort the process at exit; close now joins them.
    grid = gg.local_grid(1)
    peer = Peer(grid)
    assert peer.request("w0", {"kind": "put", "values": [[1, torch.randn(1500, 1500)]]})["ok"]
    products = [hostile.call("aten::mm.default", [Slot(i), Slot(i)], [i + 1]) for i in range(4)]
    peer.send("w0", hostile.run(products, [1, 2, 3, 4, 5]))  # ~1 s of products
    time.sleep(0.2)  # (no timing is asserted: a run that had not started just ends sooner)
    serving = [t for t in threading.enumerate() if t.name.startswith("w0-")]
    assert serving
    grid.close()
    assert not [t for t in serving if t.is_alive()]


def test_a_request_queued_behind_its_sessions_bye_gets_an_error_reply(local_grid):
    # The bye ends the session, and with it the requests queued behind it; they were
    # dropped without a reply, where every accepted request gets exactly one.
    peer = Peer(local_grid)
    assert peer.request("w0", {"kind": "put", "values": [[1, torch.randn(1500, 1500)]]})["ok"]
    products = [hostile.call("aten::mm.default", [Slot(i), Slot(i)], [i + 1]) for i in range(2)]
    busy = peer.send("w0", hostile.run(products, [1, 2, 3]))  # keeps the session busy
    bye = peer.send("w0", {"kind": "bye"})
    ping = peer.send("w0", {"kind": "ping"})  # queued behind the bye
    assert peer.reply(busy, timeout=30)["ok"]
    assert peer.reply(bye)["ok"]
    reply = peer.reply(ping)
    assert not reply["ok"] and "session ended" in reply["error"]["message"], reply


def test_a_request_that_races_its_sessions_end_gets_an_error_reply(local_grid):
    # A lease running out, or an eviction, can end a session between a request's lookup of
    # it and its queueing there: such a request was queued on the ended session and never
    # answered. Here the session is ended but still listed, as in that window.
    peer = Peer(local_grid)
    assert peer.request("w0", {"kind": "ping"})["ok"]
    session = local_grid.local_workers[0].sessions[f"{peer.transport.identity}/s"]
    with session.cv:
        session.closed = True
    reply = peer.request("w0", {"kind": "ping"})
    assert not reply["ok"] and "session ended" in reply["error"]["message"], reply


def test_a_session_whose_thread_cannot_start_gets_an_error_and_is_served_later(monkeypatch):
    # With the process out of threads, the request that needed one was queued and never
    # answered, and every later request of its session queued behind it for good.
    start = threading.Thread.start
    refused = []

    def start_or_refuse(thread: threading.Thread) -> None:
        if thread.name.startswith("w0-") and not refused:
            refused.append(thread.name)
            raise RuntimeError("can't start new thread")
        start(thread)

    with gg.local_grid(1) as grid:
        peer = Peer(grid)
        monkeypatch.setattr(threading.Thread, "start", start_or_refuse)  # (a session's next)
        reply = peer.request("w0", {"kind": "ping"}, timeout=5)
        assert refused and not reply["ok"]
        assert "could not start a thread" in reply["error"]["message"]
        assert peer.request("w0", {"kind": "ping"}, timeout=5)["ok"]  # threads back: served


def test_a_request_that_comes_while_its_session_runs_another_waits_as_received():
    # Kept decoded, a header of many small containers holds some 70 times the bytes its
    # session is charged for it: one waiting behind a run blocked in a recv held 73 MiB
    # under an 8 MiB limit.
    with gg.local_grid(2) as grid:
        peer = Peer(grid)
        waits = hostile.run([["recv", [0], "w1"]], [1], peers={"w1": "w1"})  # never sent
        blocked = peer.send("w0", waits)
        session = grid.local_workers[0].sessions
        deadline = time.monotonic() + 5
        while "mallory/s" not in session or session["mallory/s"].queue:  # until it runs
            assert time.monotonic() < deadline
            time.sleep(0.01)
        ping = peer.send("w0", {"kind": "ping", "pad": [[0, 0, 0]] * 1000})
        with session["mallory/s"].cv:
            ((kept, _, payload),) = session["mallory/s"].queue
            assert kept is None and session["mallory/s"].queued_bytes == len(payload)
        peer.send("w0", {"kind": "abort", "run": 1, "session": "s"})
        assert not peer.reply(blocked)["ok"]
        assert peer.reply(ping)["ok"]  # decoded when served


# --- runs in the order sent ------------------------------------------------------------------


def times_two_in_place(vid: int) -> dict:
    """A run that doubles value `vid` in place: (x + 1) * 2 != x * 2 + 1, so order shows."""
    step = ["call", "aten::mul_.Tensor", [Slot(0), 2.0], {}, [1], [], False]
    return {"kind": "run", "run": 3, "plan": 3, "program": [[step]], "slots": [vid, vid + 1],
            "params": []}  # fmt: skip


def test_a_run_that_overtook_the_one_sent_before_it_waits_for_it(local_grid):
    # Runs sent without waiting may arrive in any order (PubSub); each names the run sent
    # before it (`after`), and the worker serves them in the order sent.
    peer = Peer(local_grid)
    assert peer.request("w0", {"kind": "put", "values": [[1, torch.ones(1)]]}, rid="1")["ok"]
    third = peer.send("w0", {**add_one_in_place(1), "after": 3}, rid="4")  # first to arrive
    second = peer.send("w0", {**times_two_in_place(1), "after": 2}, rid="3")  # then the second
    assert peer.no_reply_within(0.3)  # both held: the first has not come
    state = local_grid.local_workers[0].sessions["mallory/s"]
    assert len(state.held) == 2 and state.queued_bytes > 0
    first = peer.send("w0", {**add_one_in_place(1), "after": 0}, rid="2")
    assert all(peer.reply(rid)["ok"] for rid in (first, second, third))
    fetch = {"kind": "run", "run": 4, "plan": 4, "program": [[["return", 0]]], "slots": [1],
             "params": []}  # fmt: skip
    [[_, value]] = peer.request("w0", fetch, rid="5")["returns"]
    assert torch.equal(value, torch.full((1,), 5.0))  # (1 + 1) * 2 + 1: in the order sent
    assert not state.held and state.queued_bytes == 0


def test_a_held_run_goes_once_the_run_before_it_is_acknowledged(local_grid):
    # Its client gave up on the run before it (never sent, or lost): it acknowledges it, and
    # the held run is served with the next request rather than held for ever.
    peer = Peer(local_grid)
    assert peer.request("w0", {"kind": "put", "values": [[1, torch.ones(1)]]}, rid="1")["ok"]
    held = peer.send("w0", {**times_two_in_place(1), "after": 2}, rid="3")
    assert peer.no_reply_within(0.3)
    assert peer.request("w0", {"kind": "ping", "ack": {"below": 3, "ids": []}}, rid="4")["ok"]
    assert peer.reply(held)["ok"]


def test_a_bye_answers_the_runs_still_held(local_grid):
    peer = Peer(local_grid)
    held = peer.send("w0", {**add_one_in_place(1), "after": 5}, rid="6")
    assert peer.request("w0", {"kind": "bye"}, rid="7")["ok"]
    assert "nothing of it ran" in peer.reply(held)["error"]["message"]
