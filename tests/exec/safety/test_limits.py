"""Per-client limits: memory and time checked before a program runs, rate, size, sessions.

Workers of `gg.local_grid(..., limits=...)` grant each client the budgets `gridgraph worker`
grants on IPFS; every result is compared with plain torch.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import queue
import threading
import time
import tracemalloc

import pytest
import torch

import gridgraph as gg
from gridgraph.exec import wire
from gridgraph.exec.protocol import MAX_NAME, MAX_REQUEST_ID, MAX_SESSION_ID, worker_topic
from gridgraph.exec.safety import kernel_checks
from gridgraph.exec.safety.limits import (
    RECORD_BYTES,
    Limits,
    MiB,
    RateLimiter,
    format_size,
    parse_size,
)
from gridgraph.exec.worker import ops, prepare
from gridgraph.exec.worker.session import ENDED_KEPT
from gridgraph.exec.worker.worker import REPLY_RESEND_GAP, RESENDS
from gridgraph.schedule.program import Param, Slot
from gridgraph.trace.allowlist import resolve
from tests.exec import hostile
from tests.exec.hostile import run
from tests.exec.local_peer import Peer

GiB = 1 << 30


def test_sizes_parse_and_print():
    assert parse_size("1GiB") == GiB and parse_size("512MiB") == GiB // 2
    assert parse_size("2e9") == 2 * 10**9 and parse_size("1.5GB") == 15 * 10**8
    with pytest.raises(ValueError, match="not a size"):
        parse_size("lots")
    assert format_size(GiB) == "1.0 GiB"


def test_an_over_limit_program_is_refused_before_anything_runs():
    with gg.local_grid(1, limits=Limits(max_client_memory=GiB)) as grid:
        peer = Peer(grid)
        a = torch.randn(4)
        assert peer.request("w0", {"kind": "put", "values": [[1, a]]})["ok"]
        add = ["call", "aten::add_.Tensor", [Slot(0), 1], {}, [1], [], False]  # would run first
        expand = ["call", "aten::expand.default", [Slot(1), [1 << 26, 4]], {}, [2], [], False]
        copy = ["call", "aten::clone.default", [Slot(2)], {}, [3], [], False]  # 1 GiB
        msg = {"kind": "run", "run": 1, "plan": 1, "slots": [1, 2, 3, 4], "params": [],
               "program": [[add, expand, copy]]}  # fmt: skip
        reply = peer.request("w0", msg)
        assert not reply["ok"] and "memory limit of 1.0 GiB" in reply["error"]["message"]
        session = grid.local_workers[0].sessions["mallory/s"]
        assert session.work.ops_run == 0 and len(session.work.store) == 1
        fetch = {"kind": "run", "run": 2, "plan": 2, "slots": [1], "params": [],
                 "program": [[["return", 0]]]}  # fmt: skip
        assert torch.equal(peer.request("w0", fetch)["returns"][0][1], a)  # add_ never ran
        x = a.send(grid.workers[0])  # the client computes within its limit
        assert torch.equal((x * 2).get(), a * 2)


def test_an_over_limit_program_from_a_client_raises_naming_the_limit():
    with gg.local_grid(1, limits=Limits(max_client_memory=GiB)) as grid:
        x = torch.randn(4).send(grid.workers[0])
        with gg.trace():
            big = x[:1].expand(1 << 28).contiguous()
        with pytest.raises(gg.RemoteError, match=r"memory limit of 1\.0 GiB"):
            big.compute()
            grid.sync()  # (compute returns once sent)
        assert grid.stats()["workers"]["w0"]["ops_run"] == 0


def test_a_put_over_the_memory_limit_is_refused_and_stores_nothing():
    with gg.local_grid(1, limits=Limits(max_client_memory=1 << 20)) as grid:
        kept = torch.randn(1000).send(grid.workers[0])
        with pytest.raises(gg.RemoteError, match="memory limit of 1.0 MiB"):
            torch.zeros(1 << 18).send(grid.workers[0])  # exactly 1 MiB, on top of kept
        assert grid.stats()["workers"]["w0"]["objects"] == 1
        assert kept.get().shape == (1000,)


def test_a_program_clearly_over_the_time_limit_is_refused_before_it_runs():
    with gg.local_grid(1, limits=Limits(max_request_seconds=10)) as grid:
        x = torch.ones(1).send(grid.workers[0])
        with gg.trace():  # 200 bytes to send, hours to run
            total = x.expand(10**6, 10**7).sum()
        refused = r"^worker 'w0' refused the request:\n.*time limit of 10 s"  # (not "? failed")
        with pytest.raises(gg.RemoteError, match=refused):
            total.get()
        assert grid.stats()["workers"]["w0"]["ops_run"] == 0


@pytest.mark.parametrize(
    "op, at",
    [("laguerre_polynomial_l", 0.5), ("legendre_polynomial_p", 0.5),
     ("chebyshev_polynomial_t", 1 + 2**-52), ("shifted_chebyshev_polynomial_w", -1e-17)],
)  # fmt: skip
def test_a_polynomial_of_huge_degree_is_refused_before_it_runs(op, at):
    # Their kernels loop `n` times for each element (at these points): one element of
    # degree 1e9 ran for 1-5 s (1e12: hours, in a kernel nothing stops) on an estimate of
    # one element.
    with gg.local_grid(1, limits=Limits(max_request_seconds=1)) as grid:
        x = torch.tensor([at], dtype=torch.float64).send(grid.workers[0])
        n = torch.tensor([1e9], dtype=torch.float64).send(grid.workers[0])
        with pytest.raises(gg.RemoteError, match=r"would run for about \d+ s, over the request"):
            getattr(torch.special, op)(x, n).get()
        assert grid.stats()["workers"]["w0"]["ops_run"] == 0
        low = torch.tensor([3.0, 5.0], dtype=torch.float64)  # honest degrees run as in torch
        want = getattr(torch.special, op)(torch.tensor([at, at], dtype=torch.float64), low)
        got = getattr(torch.special, op)(x.expand(2), low.send(grid.workers[0])).get()
        assert torch.equal(got, want)


def test_matrix_exp_is_charged_a_product_per_squaring_its_values_need():
    # matrix_exp squares once per doubling of its matrix's norm: entries of 1e300 made a
    # 512 x 512 one run 42 times as long as a normal one, past what its shape was charged.
    with gg.local_grid(1, limits=Limits(max_request_seconds=1)) as grid:
        huge = torch.full((256, 256), 1e300, dtype=torch.float64).send(grid.workers[0])
        with pytest.raises(gg.RemoteError, match=r"would run for about \d+ s, over the request"):
            torch.linalg.matrix_exp(huge).get()
        m = torch.randn(256, 256, dtype=torch.float64) / 16  # an ordinary one runs as in torch
        got = torch.linalg.matrix_exp(m.send(grid.workers[0])).get()
        assert torch.allclose(got, torch.linalg.matrix_exp(m))


def test_an_fft_of_a_prime_length_is_charged_its_scratch():
    # A prime length takes Bluestein's algorithm: an rfft of 10,000,019 floats held 760 MB
    # and ran 1.9 s, charged 120-160 MB and 0.5 ms.
    with gg.local_grid(1, limits=Limits(max_client_memory=64 * MiB)) as grid:
        x = torch.randn(2_000_003).send(grid.workers[0])  # 8 MB; the rfft needed 116 MB more
        with pytest.raises(gg.RemoteError, match="max_client_memory"):
            torch.fft.rfft(x).get()
        small = torch.randn(1001)  # ordinary ones run as in torch
        assert torch.equal(torch.fft.rfft(small.send(grid.workers[0])).get(), torch.fft.rfft(small))


def test_attention_and_rnn_layers_are_charged_their_steps():
    # Attention's work grows with queries x keys, an RNN layer's with its steps: inputs
    # expanded from one number (4 bytes) ran for seconds (minutes, at larger sizes) on an
    # estimate linear in their elements.
    with gg.local_grid(1, limits=Limits(max_request_seconds=1)) as grid:
        peer = Peer(grid)
        tensors = [torch.ones(1, 1, 1, 1), torch.zeros(1, 1), torch.zeros(4096, 1),
                   torch.zeros(4096, 1024), torch.zeros(4096), torch.ones(1, 1, 1)]  # fmt: skip
        put = {"kind": "put", "values": [[i + 1, t] for i, t in enumerate(tensors)]}
        assert peer.request("w0", put)["ok"]
        q = hostile.call("aten::expand", [Slot(0), [1, 1, 65536, 1]], [5])
        attention = hostile.call("aten::_scaled_dot_product_flash_attention_for_cpu",
                                 [Slot(5), Slot(5), Slot(5)], [6, 7])  # fmt: skip
        reply = peer.request("w0", run([q, attention], [1, 2, 3, 4, 5, 10, 11, 12]))
        assert not reply["ok"] and "max_request_seconds" in reply["error"]["message"], reply
        x = hostile.call("aten::expand", [Slot(0), [100000, 1, 1]], [5])
        hidden = hostile.call("aten::expand", [Slot(1), [1, 1024]], [6])
        lstm = hostile.call("aten::mkldnn_rnn_layer", [Slot(5), Slot(2), Slot(3), Slot(4),
                            Slot(4), Slot(6), Slot(6), False, [], 2, 1024, 1, True, False,
                            False, False], [7, 8, 9, 10])  # fmt: skip
        reply = peer.request("w0", run([x, hidden, lstm], [6, 2, 3, 4, 5, 20, 21, 22, 23, 24, 25],
                                       run_id=2))  # fmt: skip
        assert not reply["ok"] and "max_request_seconds" in reply["error"]["message"], reply
        q = torch.randn(1, 2, 8, 4)  # honest ones run as in torch
        p = q.send(grid.workers[0])
        got = torch.nn.functional.scaled_dot_product_attention(p, p, p).get()
        assert torch.allclose(got, torch.nn.functional.scaled_dot_product_attention(q, q, q))


def test_mvlgamma_of_a_huge_dimension_is_charged_what_it_allocates():
    # mvlgamma(x, p) builds p terms for each element of x: a 4-byte x and p = 1e8 held 760 MB
    # past a 256 MiB limit, charged 4 bytes.
    with gg.local_grid(1, limits=Limits(max_client_memory=64 * MiB)) as grid:
        peer = Peer(grid)
        assert peer.request("w0", {"kind": "put", "values": [[1, torch.tensor([1e9])]]})["ok"]
        mvlgamma = run([hostile.call("aten::mvlgamma", [Slot(0), 20_000_000], [1]),
                        ["return", 1]], [1, 2])  # fmt: skip
        reply = peer.request("w0", mvlgamma)
        assert not reply["ok"] and "max_client_memory" in reply["error"]["message"], reply
        x = torch.tensor([3.0, 4.0])  # and honest ones run as in torch
        assert torch.equal(torch.mvlgamma(x.send(grid.workers[0]), 3).get(), torch.mvlgamma(x, 3))


def test_a_program_running_past_the_time_limit_is_stopped_and_undone():
    with gg.local_grid(1, limits=Limits(max_request_seconds=0.2)) as grid:
        m = torch.randn(256, 256) / 16
        p = m.send(grid.workers[0])
        before = grid.stats()["workers"]["w0"]["objects"]
        with gg.trace():
            y = p
            for _ in range(3000):  # each step is quick; all of them take seconds
                y = torch.tanh(y @ p)
        with pytest.raises(gg.RemoteError, match=r"time limit"):
            y.get()
        assert grid.stats()["workers"]["w0"]["objects"] == before  # nothing left behind
        assert torch.equal((p + 1).get(), m + 1)  # the session survives


def test_each_peer_gets_its_own_request_rate():
    limits = Limits(requests_per_second=0.01, request_burst=5)
    with gg.local_grid(1, limits=limits) as grid:
        flood, polite = Peer(grid, "flood"), Peer(grid, "polite")
        replies = [flood.request("w0", {"kind": "ping"}) for _ in range(8)]
        assert [r["ok"] for r in replies] == [True] * 5 + [False] * 3
        assert "rate limit" in replies[-1]["error"]["message"]
        assert all(polite.request("w0", {"kind": "ping"})["ok"] for _ in range(5))


def test_the_rate_limiter_refills_over_time():
    bucket = RateLimiter(rate=1000.0, burst=2)
    assert bucket.allow("p") and bucket.allow("p") and not bucket.allow("p")
    threading.Event().wait(0.01)
    assert bucket.allow("p")


def test_a_message_over_the_size_limit_is_dropped_unread():
    with gg.local_grid(1, limits=Limits(max_message_bytes=4096)) as grid:
        peer = Peer(grid)
        peer.send("w0", {"kind": "put", "values": [[1, torch.zeros(2048)]]})
        assert peer.no_reply_within(0.5)
        assert not grid.local_workers[0].sessions  # nothing was even decoded
        assert peer.request("w0", {"kind": "ping"})["ok"]


def test_a_peer_holds_at_most_its_share_of_sessions_and_a_new_one_evicts_its_oldest():
    with gg.local_grid(1, limits=Limits(sessions_per_peer=2)) as grid:
        peers = [Peer(grid, "many", session=f"s{i}") for i in range(3)]
        for peer in peers:
            assert peer.request("w0", {"kind": "put", "values": [[1, torch.ones(2)]]})["ok"]
        assert not any(k.endswith("/s0") for k in grid.local_workers[0].sessions)
        fetch = {"kind": "run", "run": 1, "plan": 1, "program": [[["return", 0]]],
                 "slots": [1], "params": []}  # fmt: skip
        error = peers[0].request("w0", fetch)["error"]  # the evicted client is told so
        assert error["code"] == "session-ended" and "sessions_per_peer" in error["message"]
        assert not any(k.endswith("/s0") for k in grid.local_workers[0].sessions)
        assert torch.equal(peers[2].request("w0", fetch)["returns"][0][1], torch.ones(2))
        x = torch.randn(3)  # another peer's sessions are never evicted for it
        assert torch.equal((x.send(grid.workers[0]) + 1).get(), x + 1)


def test_another_peers_churn_does_not_make_a_worker_forget_why_my_session_ended():
    # A peer that makes and loses sessions by the hundred pushes out its own records of
    # ended sessions, never another peer's: that one is still told why its session ended.
    with gg.local_grid(1, limits=Limits(sessions_per_peer=1)) as grid:
        fetch = run([["return", 0]], [1])
        victim, rest = Peer(grid, "victim", session="a"), Peer(grid, "victim", session="b")
        assert victim.request("w0", {"kind": "put", "values": [[1, torch.ones(2)]]})["ok"]
        assert rest.request("w0", {"kind": "ping"})["ok"]  # evicts the victim's session "a"
        for i in range(3 * ENDED_KEPT):  # each new session evicts the one before
            assert Peer(grid, "churn", session=f"s{i}").request("w0", {"kind": "ping"})["ok"]
        error = victim.request("w0", fetch)["error"]
        assert error["code"] == "session-ended" and "sessions_per_peer" in error["message"]
        ended = grid.local_workers[0].ended
        assert ended.why("churn", "churn/s0") is None  # the churner's oldest were dropped
        assert ended.why("churn", f"churn/s{2 * ENDED_KEPT}") is not None


def test_a_peers_byes_do_not_make_a_worker_forget_why_it_ended_one_of_its_sessions():
    # Sessions ended by their bye are remembered too (a late request of one is refused),
    # apart: kept with the others, a node whose clients open and close grids in a loop
    # pushed out why the worker ended its other sessions ("value not stored" again).
    with gg.local_grid(1) as grid:
        victim = Peer(grid, "node", session="old")
        assert victim.request("w0", {"kind": "put", "values": [[1, torch.ones(2)]]})["ok"]
        grid.local_workers[0].expire_clients(0.0)  # its lease runs out
        for i in range(2 * ENDED_KEPT):  # the same peer: clients on the same node
            churn = Peer(grid, "node", session=f"s{i}")
            assert churn.request("w0", {"kind": "ping"})["ok"]
            assert churn.request("w0", {"kind": "bye"})["ok"]
        error = victim.request("w0", run([["return", 0]], [1]))["error"]
        assert error["code"] == "session-ended" and "lease" in error["message"], error
        late = churn.request("w0", {"kind": "ping"})["error"]  # and the last one's bye holds
        assert late["code"] == "session-ended" and "bye" in late["message"], late


def test_a_session_id_past_its_length_limit_is_refused_and_opens_nothing():
    # Each session's key is kept (and, once the worker ends it, remembered): ids of 480 KB
    # held 30 MiB of keys for one peer's 64 ended sessions.
    with gg.local_grid(1) as grid:
        peer = Peer(grid, "long", session="s" * (MAX_SESSION_ID + 1))
        reply = peer.request("w0", {"kind": "ping"})
        assert not reply["ok"] and "session id" in reply["error"]["message"], reply
        assert not grid.local_workers[0].sessions
        fits = Peer(grid, "long", session="s" * MAX_SESSION_ID)
        assert fits.request("w0", {"kind": "ping"})["ok"]


def test_a_request_id_past_its_length_limit_is_dropped_and_kept_nowhere():
    # A request's id is kept in its session's records (100,000 of them), each counted as
    # RECORD_BYTES whatever its length: a peer's pings with ids of 256 KiB held 25 MiB per
    # 100 pings on the worker, counted as 20 KB of its memory.
    with gg.local_grid(1) as grid:
        peer = Peer(grid, "long")
        for i in range(100):
            peer.send("w0", {"kind": "ping"}, rid=f"{i}-" + "r" * (256 << 10))
        assert peer.no_reply_within(0.5)  # dropped unanswered: a reply would echo the id
        assert peer.request("w0", {"kind": "ping"}, rid="r" * MAX_REQUEST_ID)["ok"]
        records = grid.local_workers[0].sessions["long/s"].records
        assert list(records) == ["r" * MAX_REQUEST_ID]


def test_names_past_their_length_limit_refuse_the_run_and_are_kept_nowhere():
    # The identities a run names for its workers are kept (`Session.named`, 256 of them),
    # uncounted: runs naming identities of 256 KiB held 64 MiB per session. So are the
    # workers it sends to, with each transfer kept for resending; on IPFS both were also
    # kept by the transport's caches once a transfer was sealed and published.
    with gg.local_grid(1) as grid:
        peer = Peer(grid, "long")
        steps = [["send", [0], "w1"], ["return", 0]]
        assert peer.request("w0", {"kind": "put", "values": [[5, torch.ones(2)]]})["ok"]
        long = "i" * (256 << 10)
        reply = peer.request("w0", run(steps, [5], peers={"w1": long}))
        assert not reply["ok"] and "identit" in reply["error"]["message"], reply
        to_long = [["send", [0], long], ["return", 0]]  # a worker named so: kept likewise
        reply = peer.request("w0", run(to_long, [5], plan=3, peers={long: "w1"}))
        assert not reply["ok"] and "identit" in reply["error"]["message"], reply
        named = grid.local_workers[0].sessions["long/s"].named
        assert long not in named
        fits = "i" * MAX_NAME
        reply = peer.request("w0", run(steps, [5], plan=2, peers={"w1": fits}))
        assert reply["ok"], reply
        assert fits in named and max(map(len, named)) == MAX_NAME


def test_an_ask_to_resend_naming_no_run_is_ignored_quietly(caplog):
    # int() of an infinite run number raised past the check: a traceback in the log for
    # every such message, before any rate check.
    with gg.local_grid(1) as grid:
        peer = Peer(grid, "w1")
        for run_id in [float("inf"), 1.0, "1"]:
            ask = {"kind": "resend", "client": "x/s", "run": run_id, "value": 0, "dst": "w1"}
            peer.publish("w0", wire.encode(ask))
        assert peer.request("w0", {"kind": "ping"})["ok"]  # (after the asks)
        assert "failed to accept" not in caplog.text


def test_a_long_request_kind_is_cut_short_in_logs_and_replies(caplog):
    # Logged and echoed whole, one message of a 512 KiB kind wrote a line that long, before
    # any rate check.
    with gg.local_grid(1) as grid:
        peer = Peer(grid, "mallory")
        kind = "k" * (512 << 10)
        peer.publish("w0", wire.encode({"kind": kind}))  # no id, no session: dropped
        reply = peer.request("w0", {"kind": kind})  # an unknown kind: refused, naming it
        assert "unknown request kind" in reply["error"]["message"]
        assert len(reply["error"]["message"]) < 200
        assert "dropped a 'kkk" in caplog.text
        assert max(len(r.getMessage()) for r in caplog.records) < 1000


@pytest.mark.parametrize(
    "field, value",
    [("src", "w" * (MAX_NAME + 1)), ("src", ["w1"]), ("run", float("inf")), ("run", 1.0)],
    ids=["long-src", "src-not-a-string", "run-inf", "run-float"],
)
def test_a_transfer_naming_what_no_run_may_name_is_dropped(field, value, caplog):
    # Its run, first value and source worker make its key in the inbox: a source of 256 KiB
    # was kept there (charged once, held twice) though no run may name it to take it; an
    # infinite run number raised past the check, with a traceback in the log each time.
    with gg.local_grid(1) as grid:
        client = Peer(grid, "many", session="s0")
        assert client.request("w0", {"kind": "ping"})["ok"]
        sender = Peer(grid, "w1")
        transfer = {"kind": "transfer", "client": "many/s0", "run": 1, "src": "w1",
                    "values": [5], "tensors": [torch.ones(2)], field: value}  # fmt: skip
        sender.publish("w0", wire.encode(transfer))
        assert sender.request("w0", {"kind": "ping"})["ok"]  # (after the transfer)
        assert not grid.local_workers[0].sessions["many/s0"].inbox
        assert "dropped a malformed transfer" in caplog.text
        assert "failed to accept" not in caplog.text  # (no traceback: it was checked)


def test_transfers_open_sessions_on_their_senders_share_and_the_client_adopts_them():
    with gg.local_grid(1, limits=Limits(sessions_per_peer=2)) as grid:
        sessions = grid.local_workers[0].sessions
        sender = Peer(grid, "w1")  # a worker whose transfers arrive before the client's run
        for i in range(3):
            transfer = {"kind": "transfer", "client": f"many/s{i}", "run": 1, "src": "w1",
                        "values": [5], "tensors": [torch.full((2,), float(i))]}  # fmt: skip
            sender.publish("w0", wire.encode(transfer))
        assert sender.request("w0", {"kind": "ping"})["ok"]  # the transfers were taken in
        assert sorted(sessions) == ["many/s0", "many/s1", "w1/s"]  # the third: over its share
        assert sessions["many/s0"].opened_by == "w1"
        # The client's own request adopts the session, and its run takes the early value.
        client = Peer(grid, "many", session="s0")
        steps = [["recv", [0], "w1"], ["return", 0]]
        reply = client.request("w0", run(steps, [5], peers={"w1": "w1"}))
        assert torch.equal(reply["returns"][0][1], torch.zeros(2)), reply
        assert sessions["many/s0"].opened_by is None


def test_a_blocked_recv_delays_no_other_client_and_ends_with_its_session(local_grid):
    peer = Peer(local_grid)
    wait_forever = {"kind": "run", "run": 1, "plan": 1, "slots": [1], "params": [],
                    "program": [[["recv", [0], "w1"]]], "peers": {"w1": "w1"}}  # fmt: skip
    rid = peer.send("w0", wait_forever)  # nobody will send it
    x = torch.randn(8)
    for _ in range(5):  # the other client is served meanwhile
        assert torch.equal((x.send(local_grid.workers[0]) * 2).get(), x * 2)
    peer.send("w0", {"kind": "abort", "run": 1})
    reply = peer.reply(rid, timeout=5)
    assert not reply["ok"] and "aborted" in reply["error"]["message"]


def test_a_recv_takes_its_value_only_from_the_worker_its_program_names(local_grid):
    peer = Peer(local_grid)
    assert peer.request("w2", {"kind": "put", "values": [[1, torch.ones(3)]]})["ok"]
    recv = {"kind": "run", "run": 1, "plan": 1, "slots": [1], "params": [],
            "program": [[["recv", [0], "w1"], ["return", 0]]], "peers": {"w1": "w1"}}  # fmt: skip
    rid = peer.send("w0", recv)
    send = {**recv, "program": [[["send", [0], "w0"]]],  # the right value, the wrong worker
            "peers": {"w0": "w0"}}  # fmt: skip
    assert peer.request("w2", send)["ok"]
    assert peer.no_reply_within(0.5)  # still waiting for w1
    peer.send("w0", {"kind": "abort", "run": 1})
    assert "aborted" in peer.reply(rid)["error"]["message"]


def test_limits_default_for_workers_and_local_grids():
    worker = Limits()
    assert worker.max_client_memory == 4 * GiB and worker.max_request_seconds == 300
    local = gg.local_grid(1)
    assert local.local_workers[0].limits == Limits.unlimited()
    local.close()


def test_an_in_place_write_to_a_view_counts_no_new_memory():
    with gg.local_grid(1, limits=Limits(max_client_memory=5 << 20)) as grid:
        a = torch.zeros(1 << 20)  # 4 MiB of the 5 MiB budget
        x = a.send(grid.workers[0])
        with gg.trace():
            x[: 1 << 19].add_(1)  # writes through a view: nothing new to hold
        x.compute()
        assert x.sum().item() == 1 << 19


def test_a_call_that_would_outgrow_the_limit_on_received_values_is_refused():
    step = ["call", "aten::expand.default", [Slot(0), [1 << 20, 4]], {}, [1], [], False]
    contiguous = ["call", "aten::clone.default", [Slot(1)], {}, [2], [], False]
    with gg.local_grid(2, limits=Limits(max_client_memory=1 << 20)) as grid:
        peer = Peer(grid)
        assert peer.request("w1", {"kind": "put", "values": [[1, torch.ones(1, 4)]]})["ok"]
        send = {"kind": "run", "run": 1, "plan": 1, "slots": [1, 2, 3], "params": [],
                "program": [[["send", [0], "w0"]]], "peers": {"w0": "w0"}}  # fmt: skip
        recv = {**send, "program": [[["recv", [0], "w1"], step, contiguous]],
                "peers": {"w1": "w1"}}  # fmt: skip
        rid = peer.send("w0", recv)
        sent = peer.send("w1", send)
        replies = _replies(peer, {rid, sent})  # (either may come first)
        assert replies[sent]["ok"]
        reply = replies[rid]
        assert not reply["ok"] and "memory limit" in reply["error"]["message"]
        assert grid.local_workers[0].sessions["mallory/s"].work.ops_run == 1  # the expand only


def test_a_run_whose_slots_name_one_value_twice_is_refused_before_anything_runs():
    # The footprint is worked out per slot. Two slots over one value: a clone written through
    # the second changes what the first holds, so the walk would see a 1x1 tensor where the
    # run has a big one, and pass an mm that allocates far over the limit.
    n = 4000
    steps = [hostile.call("aten::clone.default", [Slot(2)], [1]),  # slot 1 is value 100 too
             hostile.call("aten::t.default", [Slot(0)], [3]),
             hostile.call("aten::mm.default", [Slot(0), Slot(3)], [4])]  # fmt: skip
    with gg.local_grid(1, limits=Limits(max_client_memory=1 << 20)) as grid:
        peer = Peer(grid)
        put = {"kind": "put", "values": [[100, torch.ones(1, 1)], [5, torch.ones(n, 1)]]}
        assert peer.request("w0", put)["ok"]
        reply = peer.request("w0", hostile.run(steps, [100, 100, 5, 101, 102]))
        assert not reply["ok"] and "distinct" in reply["error"]["message"], reply
        assert grid.local_workers[0].sessions["mallory/s"].work.ops_run == 0
        got = peer.request("w0", hostile.run([["return", 0]], [100], plan=2))
        assert got["ok"] and torch.equal(got["returns"][0][1], torch.ones(1, 1))


def test_transfers_over_the_memory_limit_do_not_grow_a_sessions_inbox_past_it():
    # A transfer that would take a session over its memory limit is kept as a small error in
    # its place (so that a run waiting for it fails at once, naming the limit). A peer sends
    # its own session transfers under keys no run takes: were each kept as an error, the
    # inbox would grow past the limit, without bound, in the worker's own process.
    cap = 64 << 10
    with gg.local_grid(1, limits=Limits(max_client_memory=cap)) as grid:
        peer = Peer(grid)
        fill = torch.zeros((cap - 8192) // 4)
        for vid, tensors in [(1, [fill])] + [(vid, [torch.zeros(1)]) for vid in range(2, 2002)]:
            transfer = {"kind": "transfer", "client": "mallory/s", "run": 1, "src": "w1",
                        "values": [vid], "tensors": tensors}  # fmt: skip
            peer.publish("w0", wire.encode(transfer))
        stats = peer.request("w0", {"kind": "stats"})
        assert stats["ok"] and stats["memory"] - RECORD_BYTES <= cap, stats  # (its record)


def test_each_transfer_an_inbox_keeps_is_charged_its_bookkeeping():
    # Tiny transfers under keys no run takes: each costs the worker its key, a bytes object
    # and dictionary entries beside its payload, 4x the payload's bytes. Charged the
    # payload only, a session's inbox held about 4x its memory limit.
    cap = 64 << 10
    with gg.local_grid(1, limits=Limits(max_client_memory=cap)) as grid:
        peer = Peer(grid)
        assert peer.request("w0", {"kind": "ping"})["ok"]  # the session exists
        logging.disable(logging.WARNING)  # pytest keeps each log record: not the worker's
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for vid in range(1, 2001):
                transfer = {"kind": "transfer", "client": "mallory/s", "run": 1, "src": "w1",
                            "values": [vid], "tensors": [torch.zeros(1)]}  # fmt: skip
                peer.publish("w0", wire.encode(transfer))
            assert peer.request("w0", {"kind": "ping"})["ok"]
            held = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
            logging.disable(logging.NOTSET)
        assert grid.local_workers[0].sessions["mallory/s"].inbox  # some were kept
        assert held <= 1.25 * cap, held


@pytest.mark.parametrize("kind", ["ping", "no-such-kind", "bye"])
def test_refusals_of_a_peer_over_its_rate_are_rate_limited_too(kind):
    # Each refusal is a message from the worker's one shared sender thread (on IPFS, a Kubo
    # publish of ~1 ms). Unbounded, a peer's flood of tiny requests over its rate queued a
    # refusal for each, ahead of every other client's replies. A `bye` for a session that
    # is not there (this peer opens none) was answered every time, outside any rate.
    with gg.local_grid(1, limits=Limits(requests_per_second=0.01, request_burst=5)) as grid:
        peer = Peer(grid)
        for _ in range(50):
            peer.send("w0", {"kind": kind})
        answered = 0
        while not peer.no_reply_within(0.5):
            answered += 1
        assert 5 <= answered <= 10  # within its rate, then a refusal burst as large


def test_resends_of_an_answered_request_count_against_the_peers_rate():
    # A resend of a request whose reply is kept gets that reply again, from the worker's
    # one shared sender thread. Uncounted, ~200 bytes asking again for a large reply made
    # the worker publish it again as often as a peer liked, past its rate limit.
    with gg.local_grid(1, limits=Limits(requests_per_second=0.01, request_burst=5)) as grid:
        peer = Peer(grid)
        big = torch.arange(1 << 16, dtype=torch.float32)
        assert peer.request("w0", {"kind": "put", "values": [[1, big]]})["ok"]
        fetch = run([["return", 0]], [1])
        first = peer.request("w0", fetch, rid="big")
        assert torch.equal(first["returns"][0][1], big)  # 2 of the 5 requests so far
        for _ in range(20):
            peer.send("w0", fetch, rid="big")
        again = 0
        while not peer.no_reply_within(0.5):
            again += 1
        assert 1 <= again <= 3  # answered while within its rate: 3 of the burst were left


def test_asks_to_resend_a_kept_transfer_count_against_the_askers_rate():
    # A transfer a run sent is kept, and sent again whenever the identity it went to asks
    # (ipfs: PubSub drops messages). A client may name itself as that identity: uncounted,
    # its small asks made the worker's shared sender thread publish the transfer again as
    # often as it liked, past its rate limit.
    with gg.local_grid(1, limits=Limits(requests_per_second=0.01, request_burst=5)) as grid:
        peer = Peer(grid)
        copies = []
        peer.transport.subscribe(worker_topic("x"), lambda sender, payload: copies.append(1))
        big = torch.arange(1 << 16, dtype=torch.float32)
        assert peer.request("w0", {"kind": "put", "values": [[1, big]]})["ok"]
        send = run([["send", [0], "x"]], [1], peers={"x": peer.transport.identity})
        assert peer.request("w0", send)["ok"]  # 2 of the 5 requests so far
        assert len(copies) == 1
        ask = {"kind": "resend", "client": "mallory/s", "run": 1, "value": 1, "dst": "x"}
        for _ in range(20):
            peer.publish("w0", wire.encode(ask))
        # (the worker's sender thread sends in order: once this reply, a refusal over the
        # rate, is here, all went)
        assert "rate limit" in peer.request("w0", {"kind": "ping"})["error"]["message"]
        assert 1 <= len(copies) - 1 <= 3  # sent again while within its rate


def test_a_kept_reply_or_transfer_is_sent_again_a_few_times_at_most_and_never_refused():
    # Within a generous rate (2,000 at once by default), one small ask after another made
    # the worker's shared sender publish the same large reply or transfer again each time:
    # 2,000 asks for a 64 MiB transfer would publish 128 GB, ahead of everyone's replies.
    with gg.local_grid(1) as grid:
        peer = Peer(grid)
        copies = []
        peer.transport.subscribe(worker_topic("x"), lambda sender, payload: copies.append(1))
        big = torch.arange(1 << 16, dtype=torch.float32)
        assert peer.request("w0", {"kind": "put", "values": [[1, big]]})["ok"]
        send = run([["send", [0], "x"], ["return", 0]], [1], peers={"x": peer.transport.identity})
        assert peer.request("w0", send, rid="big")["ok"] and len(copies) == 1
        ask = {"kind": "resend", "client": "mallory/s", "run": 1, "value": 1, "dst": "x"}
        for _ in range(50):
            peer.publish("w0", wire.encode(ask))
            peer.send("w0", send, rid="big")  # its reply "lost" again and again
        time.sleep(2 * REPLY_RESEND_GAP)
        peer.send("w0", send, rid="big")  # asked once more, after a while
        answers = []
        with contextlib.suppress(queue.Empty):
            while True:
                answers.append(peer.replies.get(timeout=1.0))
        again = [a for a in answers if a.get("re") == "big"]
        # RESENDS copies of the reply, then one more paced in time, never an error: the
        # request ran. (Refused as "sent 4 times again already", requests that ran got that
        # error under load, while their replies were only slow.)
        assert RESENDS <= len(again) <= RESENDS + 2 and all(a["ok"] for a in again), again
        assert len(copies) - 1 == RESENDS


def test_transfers_waiting_in_an_inbox_hold_no_more_than_they_count():
    # A transfer waits in the inbox of the session it names, counted at its size on the
    # wire. Kept decoded, a message of 16,000 empty tensors (300 kB) held 16,000 tensor
    # objects (about 8 MB): 26x what the session's memory limit saw, in the worker's own
    # process, whatever runs the programs.
    with gg.local_grid(1, limits=Limits(max_client_memory=GiB)) as grid:
        peer = Peer(grid)
        empties = [torch.empty(0) for _ in range(16_000)]
        assert peer.request("w0", {"kind": "ping"})["ok"]
        before = _tensors_alive()
        for run_id in range(1, 6):
            transfer = {"kind": "transfer", "client": "mallory/s", "run": run_id, "src": "w1",
                        "values": list(range(16_000)), "tensors": empties}  # fmt: skip
            peer.publish("w0", wire.encode(transfer))
        charged = grid.local_workers[0].budget.held("mallory")  # (no run of the session named it)
        assert charged > 5 * 16_000 * 14
        assert _tensors_alive() - before < 16_000


def _tensors_alive() -> int:
    gc.collect()
    return sum(type(o) is torch.Tensor for o in gc.get_objects())


def test_requests_waiting_in_a_sessions_queue_hold_at_most_its_memory_limit():
    # A session's requests wait while one of them runs (here a recv nobody satisfies).
    # Unbounded, a peer could queue as many large puts behind it as its request rate
    # allows (2,000 of up to 256 MiB each by default), all held in the worker's network
    # process, each checked against the memory limit only when its turn came.
    cap = 1 << 20
    with gg.local_grid(1, limits=Limits(max_client_memory=cap)) as grid:
        peer = Peer(grid)
        wait = run([["recv", [0], "w1"]], [9], run_id=7, peers={"w1": "w1"})
        blocked = peer.send("w0", wait)
        puts = [peer.send("w0", {"kind": "put", "values": [[i, torch.zeros(1 << 16)]]})
                for i in range(8)]  # fmt: skip
        session = grid.local_workers[0].sessions["mallory/s"]
        assert sum(len(payload) for _, _, payload in session.queue) <= cap
        replies = _replies(peer, {puts[-1]})  # at once, while the recv still waits
        assert "memory limit" in replies[puts[-1]]["error"]["message"], replies[puts[-1]]
        peer.send("w0", {"kind": "abort", "run": 7})
        replies.update(_replies(peer, {blocked, *puts} - replies.keys()))
        assert not replies[blocked]["ok"]
        stored = [replies[rid]["ok"] for rid in puts]
        assert stored == sorted(stored, reverse=True) and stored[0]  # the first ones fit
        assert peer.request("w0", {"kind": "stats"})["objects"] == sum(stored)


def _replies(peer: Peer, rids: set[str]) -> dict[str, dict]:
    """Replies to the requests `rids` (and any others that come first), by request id."""
    got: dict[str, dict] = {}
    while not rids <= got.keys():
        reply = peer.replies.get(timeout=20)
        got[reply["re"]] = reply
    return got


def test_the_rate_limiter_forgets_peers_whose_buckets_refilled():
    # Past 100,000 peers the limiter forgets those long gone. It judged a bucket by its
    # tokens when last used, not refilled since: a peer that sent one request stayed
    # forever, and so many identities made every later request rebuild the whole table.
    bucket = RateLimiter(rate=1000.0, burst=2)
    for i in range(100_001):
        assert bucket.allow(f"peer-{i}")  # each left with 1 of its 2 tokens
    threading.Event().wait(0.01)  # all refilled by now
    assert bucket.allow("one more")
    assert len(bucket._buckets) < 100


def test_requests_waiting_in_a_sessions_queue_hold_no_more_than_they_count():
    # Behind a run that waits, 20 puts of 16,000 empty tensors each: 4.6 MB on the wire,
    # within the limit, but 320,000 tensor objects (about 160 MB) while they wait. (Sent at
    # once, unpaced: no rate of requests or of header bytes applies, safety/intake.py.)
    limits = Limits(max_client_memory=GiB, requests_per_second=math.inf)
    with gg.local_grid(1, limits=limits) as grid:
        peer = Peer(grid)
        wait = run([["recv", [0], "w1"]], [9], run_id=7, peers={"w1": "w1"})
        blocked = peer.send("w0", wait)
        empties = [torch.empty(0) for _ in range(16_000)]
        before = _tensors_alive()
        puts = []
        for i in range(20):
            values = [[i * 16_000 + j, t] for j, t in enumerate(empties)]
            puts.append(peer.send("w0", {"kind": "put", "values": values}))
        grown = _tensors_alive() - before
        peer.send("w0", {"kind": "abort", "run": 7})
        _replies(peer, {blocked, *puts})
        assert grown <= 16_000  # the first only, which found the queue empty


def test_a_parameter_listing_tensors_is_worked_out_on_meta_tensors_and_by_its_layouts(
    monkeypatch,
):
    # Its footprint is worked out before the run on meta tensors, never on the real ones (a
    # block_diag of many 1x1 tensors would allocate there, unchecked), and remembered by
    # the layouts of the tensors it lists: by repr, lists of 32x32 and of 300x300 zeros
    # looked alike (torch summarises both), so the small run's footprint passed the big.
    devices = []
    footprint = prepare.op_footprint

    def spy(op, args, kwargs):
        devices.extend(t.device.type for a in args if isinstance(a, list) for t in a)
        return footprint(op, args, kwargs)

    monkeypatch.setattr(prepare, "op_footprint", spy)
    block_diag = [hostile.call("aten::block_diag.default", [Param(0)], [0]), ["return", 0]]
    with gg.local_grid(1, limits=Limits(max_client_memory=1 << 20)) as grid:
        peer = Peer(grid)
        small = [torch.zeros(32, 32)] * 2
        reply = peer.request("w0", hostile.run(block_diag, [7], params=[[0, small]]))
        assert reply["ok"] and torch.equal(reply["returns"][0][1], torch.block_diag(*small))
        assert devices and set(devices) == {"meta"}
        ran = grid.local_workers[0].sessions["mallory/s"].work.ops_run
        big = [torch.zeros(300, 300)] * 2  # 720 kB sent; its block_diag 1.4 MB, over the limit
        again = hostile.run(block_diag, [8], run_id=2, params=[[0, big]], program=False)
        reply = peer.request("w0", again)
        assert not reply["ok"] and "memory limit" in reply["error"]["message"], reply
        assert grid.local_workers[0].sessions["mallory/s"].work.ops_run == ran  # refused first


def test_a_resize_that_would_grow_past_the_limit_is_refused_before_anything_runs():
    # resize_ grows its tensor's storage in place: no new storage, so its growth was counted
    # as nothing, and 400 MB were allocated against a 1 MiB limit before the check after
    # the call noticed.
    grow = [hostile.call("aten::clone.default", [Slot(0)], [1]),
            hostile.call("aten::resize_.default", [Slot(1), [100_000_000]], [2])]  # fmt: skip
    small = [hostile.call("aten::clone.default", [Slot(0)], [1]),
             hostile.call("aten::resize_.default", [Slot(1), [1000]], [2]),
             ["return", 2]]  # fmt: skip
    with gg.local_grid(1, limits=Limits(max_client_memory=1 << 20)) as grid:
        peer = Peer(grid)
        assert peer.request("w0", {"kind": "put", "values": [[1, torch.ones(1)]]})["ok"]
        reply = peer.request("w0", hostile.run(grow, [1, 2, 3]))
        assert not reply["ok"] and "memory limit" in reply["error"]["message"], reply
        assert grid.local_workers[0].sessions["mallory/s"].work.ops_run == 0
        reply = peer.request("w0", hostile.run(small, [1, 4, 5], plan=2))
        want = torch.ones(1).clone().resize_(1000)
        want[1:] = 0  # (memory a resize grows into is zeroed on a worker)
        assert reply["ok"] and torch.equal(reply["returns"][0][1], want), reply


HUGE_DATA_DEPENDENT = {
    # op, its input (under the limit), what the op makes of it in plain torch at small size
    "bincount": ("aten::bincount.default", torch.tensor([10**9]), torch.tensor([1, 1, 3])),
    "repeat_interleave": (
        "aten::repeat_interleave.Tensor",
        torch.tensor([10**9]),
        torch.tensor([2, 0, 3]),
    ),
    "nonzero": ("aten::nonzero.default", torch.ones((8,) * 6, dtype=torch.bool), torch.eye(3)),
}


@pytest.mark.parametrize("case", HUGE_DATA_DEPENDENT.values(), ids=HUGE_DATA_DEPENDENT.keys())
def test_an_op_whose_output_its_data_sizes_is_refused_before_it_runs_past_the_limit(case):
    # No meta kernel can say how much these make; they were taken to make no more than their
    # input. bincount of one number allocated 7.5 GiB against a 1 MiB limit, checked only after.
    op, huge, small = case
    with gg.local_grid(1, limits=Limits(max_client_memory=1 << 20)) as grid:
        peer = Peer(grid)
        assert peer.request("w0", {"kind": "put", "values": [[1, huge], [2, small]]})["ok"]
        reply = peer.request("w0", hostile.run([hostile.call(op, [Slot(0)], [1])], [1, 3]))
        assert not reply["ok"] and "memory limit" in reply["error"]["message"], reply
        assert grid.local_workers[0].sessions["mallory/s"].work.ops_run == 0
        steps = [hostile.call(op, [Slot(0)], [1]), ["return", 1]]
        reply = peer.request("w0", hostile.run(steps, [2, 4], plan=2))
        want = getattr(torch.ops.aten, op.split("::")[1].split(".")[0])(small)
        assert reply["ok"] and torch.equal(reply["returns"][0][1], want), reply


def test_a_layout_change_through_one_of_two_ids_of_one_tensor_is_seen_by_the_other():
    # add_ returns its input: its result is stored under a value id of its own and is the
    # same tensor object. An as_strided_ through one id changes the other's layout; the walk
    # gave each id a meta tensor of its own, so a clone through the other passed as 4 bytes
    # and copied N x N. It must also not reuse the footprint of a run where the two ids held
    # two tensors of the same layouts.
    n = 2000
    alias = [hostile.call("aten::clone.default", [Slot(0)], [1]),
             hostile.call("aten::add_.Tensor", [Slot(1), 1.0], [2])]  # fmt: skip
    grow = [hostile.call("aten::as_strided_.default", [Slot(0), [n, n], [0, 0]], [2]),
            hostile.call("aten::clone.default", [Slot(1)], [3])]  # fmt: skip
    with gg.local_grid(1, limits=Limits(max_client_memory=1 << 20)) as grid:
        peer = Peer(grid)
        put = {"kind": "put", "values": [[1, torch.ones(1, 1)], [20, torch.ones(1, 1)],
                                         [21, torch.ones(1, 1)]]}  # fmt: skip
        assert peer.request("w0", put)["ok"]
        # two tensors, same layouts: fine, and its footprint is remembered
        assert peer.request("w0", hostile.run(grow, [20, 21, 22, 23], plan=2, run_id=1))["ok"]
        assert peer.request("w0", hostile.run(alias, [1, 10, 11], run_id=2))["ok"]
        ran = grid.local_workers[0].sessions["mallory/s"].work.ops_run
        again = hostile.run(grow, [10, 11, 12, 13], plan=2, run_id=3, program=False)
        reply = peer.request("w0", again)
        assert not reply["ok"] and "memory limit" in reply["error"]["message"], reply
        assert grid.local_workers[0].sessions["mallory/s"].work.ops_run == ran  # refused first


def test_storage_a_resize_grows_is_counted_even_when_its_run_then_fails():
    # A resize_ whose step names no output makes its run fail after the op ran ("returned 1
    # tensors, expected 0"). The storage it grew stays with the stored tensor: it was never
    # counted, so a session could grow stored tensors without end under a 1 MiB limit.
    with gg.local_grid(1, limits=Limits(max_client_memory=1 << 20)) as grid:
        peer = Peer(grid)
        state = None
        for k in range(3):
            assert peer.request("w0", {"kind": "put", "values": [[10 + k, torch.ones(1)]]})["ok"]
            clone = [hostile.call("aten::clone.default", [Slot(0)], [1])]  # resizable storage
            assert peer.request("w0", hostile.run(clone, [10 + k, 20 + k], plan=10 + k))["ok"]
            grow = [hostile.call("aten::resize_.default", [Slot(0), [100_000]], [])]  # 400 kB
            reply = peer.request("w0", hostile.run(grow, [20 + k], plan=20 + k, run_id=k))
            assert not reply["ok"], reply
            state = grid.local_workers[0].sessions["mallory/s"]
            held = sum(
                state.work.store.get(20 + i).untyped_storage().nbytes() for i in range(k + 1)
            )
            assert state.work.store.stored_bytes >= held
        assert "memory limit" in reply["error"]["message"]  # the third: refused before it ran
        assert state.work.store.get(22).untyped_storage().nbytes() == 4


def test_a_call_its_meta_kernel_refuses_never_runs_its_kernel(monkeypatch):
    # grid_sampler_2d's CPU kernel takes an interpolation mode of 7 and returns its output
    # unwritten: heap bytes, maybe another client's. Its meta kernel refuses the mode. With
    # the op's own argument check taken away, that refusal alone keeps its kernel from
    # running (it was taken as "meta cannot tell", and the kernel ran).
    monkeypatch.delitem(kernel_checks.CHECKS, "aten::grid_sampler_2d")
    # Each op's runner is made once, with its check or without: made again here, without
    # it, and again after the test, with the check put back.
    ops.runner.cache_clear()
    try:
        with gg.local_grid(1) as grid:
            image, where = torch.randn(1, 1, 4, 4), torch.rand(1, 8, 8, 2) * 2 - 1
            values = [[1, image], [2, where]]
            assert Peer(grid).request("w0", {"kind": "put", "values": values})["ok"]
            add = hostile.call("aten::add.Tensor", [Slot(0), Slot(0)], [2])
            sample = hostile.call(
                "aten::grid_sampler_2d.default", [Slot(0), Slot(1), 7, 0, False], [3]
            )
            reply = Peer(grid).request(
                "w0", hostile.run([add, sample, ["return", 3]], [1, 2, 10, 11])
            )
            assert not reply["ok"] and "interpolation mode 7" in reply["error"]["message"], reply
            assert grid.local_workers[0].sessions["mallory/s"].work.ops_run == 1  # the add only
            sample = hostile.call(
                "aten::grid_sampler_2d.default", [Slot(0), Slot(1), 0, 0, False], [2]
            )
            got = _returns(grid, [sample, ["return", 2]], [1, 2, 12])  # honest modes run
            assert torch.equal(got[0], torch.grid_sampler_2d(image, where, 0, 0, False))
    finally:
        ops.runner.cache_clear()


# Calls whose CPU kernels take what their meta kernels refuse, found by a scan of 17,415
# mutated arguments of OpInfo's calls (on 8,993 that meta refused, the CPU kernel returned
# 204 times, crashed 170 times and tried allocations of up to 51 GB 33 times; most of those
# have checks of their own now). name -> (inputs, op, args, the meta kernel's refusal)
META_REFUSES = {
    "a negative output size": ([torch.randn(0, 8, 1, 8)], "aten::_adaptive_avg_pool2d.default",
                               [Slot(0), [-1, 5]], "negative dimension"),
    "a reduction that names none": ([torch.randn(5), torch.randn(5)],
                                    "aten::huber_loss.default", [Slot(0), Slot(1), 2**62, 1.0],
                                    "not a valid value for reduction"),
    "a dim out of range": ([torch.randn(0, 0, 0)], "aten::roll.default",
                           [Slot(0), [1], [2**31]], "Dimension out of range"),
    "negative repeats": ([torch.randn(0)], "aten::repeat.default", [Slot(0), [-1]],
                         "Repeats cannot be negative"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(META_REFUSES))
def test_a_call_its_meta_kernel_refuses_is_refused(case):
    # Each returned a result (a tensor of size (0, 8, -1, 5) for the negative output size)
    inputs, op, args, refusal = META_REFUSES[case]
    with gg.local_grid(1) as grid:
        values = [[1 + i, t] for i, t in enumerate(inputs)]
        assert Peer(grid).request("w0", {"kind": "put", "values": values})["ok"]
        slot = len(inputs)
        steps = [hostile.call(op, args, [slot]), ["return", slot]]
        reply = Peer(grid).request("w0", hostile.run(steps, [1 + i for i in range(slot + 1)]))
        assert not reply["ok"] and refusal in reply["error"]["message"], reply
        assert grid.local_workers[0].sessions["mallory/s"].work.ops_run == 0


def test_a_nearest_upsampling_of_an_empty_batch_is_checked_by_the_cpu_kernels_rule():
    # torch's meta kernel raised a TypeError ("cond must be a bool") for it, which the
    # worker took as a refusal of a call that plain torch runs (to an empty batch)
    with gg.local_grid(1, limits=Limits(max_client_memory=1 << 20)) as grid:
        for shape, op, want in [
            ((0, 3, 4, 4), "aten::upsample_nearest2d.default", torch.Size([0, 3, 3, 3])),
            ((0, 0, 4, 4), "aten::upsample_nearest2d.default", "Non-empty 4D data tensor"),
            ((0, 1, 4), "aten::_upsample_nearest_exact1d.default", torch.Size([0, 1, 3])),
        ]:
            x = torch.randn(shape)
            assert Peer(grid).request("w0", {"kind": "put", "values": [[1, x]]})["ok"]
            size = [3] * (len(shape) - 2)
            steps = [hostile.call(op, [Slot(0), size], [1]), ["return", 1]]
            reply = Peer(grid).request("w0", hostile.run(steps, [1, 2]))
            if isinstance(want, str):
                assert not reply["ok"] and want in reply["error"]["message"], reply
            else:
                assert reply["ok"], reply
                assert reply["returns"][0][1].shape == want == resolve(op)(x, size).shape


def test_a_nearest_upsampling_of_an_empty_batch_is_made_without_its_kernel():
    # The CPU kernel builds an 8-byte index per output position even for an empty batch,
    # charged nothing (the result holds no element): 2**26 positions took 512 MB, 2**40
    # failed to allocate 8 TB. The result is an empty tensor of that shape.
    with gg.local_grid(1, limits=Limits(max_client_memory=1 << 20)) as grid:
        assert Peer(grid).request("w0", {"kind": "put", "values": [[1, torch.randn(0, 1, 4)]]})[
            "ok"
        ]
        for plan, size in enumerate([2**10, 2**40]):
            steps = [hostile.call("aten::upsample_nearest1d.default", [Slot(0), [size]], [1]),
                     ["return", 1]]  # fmt: skip
            reply = Peer(grid).request(
                "w0", hostile.run(steps, [1, 2 + plan], plan=plan, run_id=1 + plan)
            )
            assert reply["ok"], reply
            assert reply["returns"][0][1].shape == (0, 1, size)
        want = torch.ops.aten.upsample_nearest1d.default(torch.randn(0, 1, 4), [2**10])
        assert want.shape == (0, 1, 2**10)
        # a dtype the kernel takes none of is refused as torch refuses it
        ints = torch.zeros(0, 1, 4, dtype=torch.int64)
        with pytest.raises(NotImplementedError) as refused:
            torch.ops.aten.upsample_nearest1d.default(ints, [3])
        assert Peer(grid).request("w0", {"kind": "put", "values": [[5, ints]]})["ok"]
        steps = [hostile.call("aten::upsample_nearest1d.default", [Slot(0), [3]], [1]),
                 ["return", 1]]  # fmt: skip
        reply = Peer(grid).request("w0", hostile.run(steps, [5, 6], plan=9, run_id=9))
        assert not reply["ok"] and str(refused.value) in reply["error"]["message"], reply


def _refused_before_it_runs(grid, steps: list, slots: list, ran_before: int) -> None:
    peer = Peer(grid)
    reply = peer.request("w0", hostile.run(steps, slots, plan=len(slots)))
    assert not reply["ok"] and "memory limit" in reply["error"]["message"], reply
    assert grid.local_workers[0].sessions["mallory/s"].work.ops_run == ran_before


def _returns(grid, steps: list, slots: list) -> list:
    reply = Peer(grid).request("w0", hostile.run(steps, slots, plan=100 + len(slots)))
    assert reply["ok"], reply
    return [t for _, t in reply["returns"]]


# No meta kernel says how much these make. Each was taken to make no more than its input's
# bytes; broadcasting, an expanded input or a bin count make far more. Now each is bounded
# from its arguments (their elements, or the bin count) and refused before it runs.


def test_a_masked_select_that_broadcasts_past_the_limit_is_refused_before_it_runs():
    with gg.local_grid(1, limits=Limits(max_client_memory=1 << 20)) as grid:
        x, mask = torch.ones(6000, 1), torch.ones(1, 6000, dtype=torch.bool)  # 36M elements
        small_x, small_mask = torch.arange(6.0).reshape(3, 2), torch.tensor([True, False])
        values = [[1, x], [2, mask], [3, small_x], [4, small_mask]]
        assert Peer(grid).request("w0", {"kind": "put", "values": values})["ok"]
        select = [hostile.call("aten::masked_select.default", [Slot(0), Slot(1)], [2])]
        _refused_before_it_runs(grid, select, [1, 2, 10], 0)
        got = _returns(grid, [*select, ["return", 2]], [3, 4, 11])
        assert torch.equal(got[0], torch.masked_select(small_x, small_mask))


def test_a_unique_of_an_expanded_tensor_past_the_limit_is_refused_before_it_runs():
    with gg.local_grid(1, limits=Limits(max_client_memory=1 << 20)) as grid:
        small = torch.tensor([3, 1, 3, 2])
        assert Peer(grid).request("w0", {"kind": "put", "values": [[1, torch.ones(1)],
                                                                   [2, small]]})["ok"]  # fmt: skip
        expand = hostile.call("aten::expand.default", [Slot(0), [20_000_000]], [1])
        unique = hostile.call("aten::_unique2.default", [Slot(1), True, True, True], [2, 3, 4])
        _refused_before_it_runs(grid, [expand, unique], [1, 10, 11, 12, 13], 1)  # (the expand)
        unique = hostile.call("aten::_unique2.default", [Slot(0), True, True, True], [1, 2, 3])
        got = _returns(grid, [unique, ["return", 1], ["return", 2], ["return", 3]],
                       [2, 20, 21, 22])  # fmt: skip
        want = torch.ops.aten._unique2.default(small, True, True, True)
        assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_a_histogram_of_more_bins_than_the_limit_holds_is_refused_before_it_runs():
    with gg.local_grid(1, limits=Limits(max_client_memory=1 << 20)) as grid:
        x = torch.tensor([0.0, 1.0, 1.0, 3.0])
        assert Peer(grid).request("w0", {"kind": "put", "values": [[1, x]]})["ok"]
        many = [hostile.call("aten::histogram.bin_ct", [Slot(0), 50_000_000], [1, 2])]
        _refused_before_it_runs(grid, many, [1, 10, 11], 0)
        few = [hostile.call("aten::histogram.bin_ct", [Slot(0), 4], [1, 2]), ["return", 1],
               ["return", 2]]  # fmt: skip
        got = _returns(grid, few, [1, 20, 21])
        want = torch.ops.aten.histogram.bin_ct(x, 4)
        assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_an_op_without_a_meta_kernel_over_the_time_limit_is_refused_before_it_runs():
    # Its work is bounded from its arguments' elements too, not only its memory: a
    # masked_select of a 200,000 x 1 tensor by a 1 x 200,000 mask reads 4 x 10^10 elements
    # (its work was taken as nothing).
    with gg.local_grid(1, limits=Limits(max_client_memory=None, max_request_seconds=1)) as grid:
        n = 200_000
        x, mask = torch.ones(n, 1), torch.ones(1, n, dtype=torch.bool)
        assert Peer(grid).request("w0", {"kind": "put", "values": [[1, x], [2, mask]]})["ok"]
        select = hostile.call("aten::masked_select.default", [Slot(0), Slot(1)], [2])
        reply = Peer(grid).request("w0", hostile.run([select], [1, 2, 10]))
        assert not reply["ok"] and "would run for" in reply["error"]["message"], reply
        assert grid.local_workers[0].sessions["mallory/s"].work.ops_run == 0


def test_growth_of_a_storage_held_outside_the_run_stays_counted_when_its_slots_are_freed():
    # Two stored values over one storage (a clone and its alias); a run resizes one, frees
    # both of its slots and then clones 920 kB. The walk took the growth back at the frees,
    # but the value outside the run keeps the storage grown: 1.8 MiB in all, over the limit.
    n = 230_000
    with gg.local_grid(1, limits=Limits(max_client_memory=1 << 20)) as grid:
        peer = Peer(grid)
        put = {"kind": "put", "values": [[1, torch.ones(1)], [9, torch.ones(1)]]}
        assert peer.request("w0", put)["ok"]
        share = [hostile.call("aten::clone.default", [Slot(0)], [1]),
                 hostile.call("aten::alias.default", [Slot(1)], [2])]  # fmt: skip
        assert peer.request("w0", hostile.run(share, [1, 2, 3]))["ok"]
        steps = [hostile.call("aten::resize_.default", [Slot(0), [n]], [1]), ["free", 0],
                 ["free", 1], hostile.call("aten::expand.default", [Slot(2), [n]], [3]),
                 hostile.call("aten::clone.default", [Slot(3)], [4])]  # fmt: skip
        reply = peer.request("w0", hostile.run(steps, [3, 4, 9, 5, 6], plan=2, run_id=2))
        assert not reply["ok"] and "memory limit" in reply["error"]["message"], reply
        assert grid.local_workers[0].sessions["mallory/s"].work.ops_run == 2  # (the first run's)


def test_a_long_chain_of_ops_is_checked_at_what_it_holds_at_once_not_in_all():
    # Each step's intermediate is freed by the next: 200 of 1 MB are 200 MB in all, but 2 MB
    # at once. (The walk's storage keys are meta storages' addresses, which freed ones give
    # back; one reused key was once taken for a storage held already, never freed.)
    x = torch.randn(1 << 18)  # 1 MiB
    with gg.local_grid(1, limits=Limits(max_client_memory=8 << 20)) as grid:
        p = x.send(grid.workers[0])
        with gg.trace():
            y = p
            for _ in range(100):
                y = torch.sin(y) * 1.0001
        want = x
        for _ in range(100):
            want = torch.sin(want) * 1.0001
        assert torch.equal(y.get(), want)


# Scratch memory: what an op allocates inside itself and frees before it returns. Meta shows
# only its results, so each of these passed the check and allocated many times the limit
# (an expanded input costs 4 bytes to hold and gigabytes to copy, sort or unfold). Each is
# now charged before it runs, in the run's peak but not in what the session holds after.


@pytest.mark.parametrize(
    "op, args, outs",
    [
        ("aten::isin.Tensor_Tensor", [Slot(1), Slot(2)], [5]),  # sorts both: 24 B/element
        ("aten::median.default", [Slot(2)], [5]),  # a contiguous copy to select in
        ("aten::mm.default", [Slot(3), Slot(4)], [5]),  # contiguous copies of 1 x N and N x 1
        ("aten::aminmax.default", [Slot(2)], [5, 6]),  # a reduction, copying its input
    ],
    ids=["isin", "median", "mm", "aminmax"],
)
def test_an_op_whose_scratch_memory_would_pass_the_limit_is_refused_before_it_runs(op, args, outs):
    n = 1 << 22  # 16 MiB of float32 for a 1 MiB limit: each op below took 16-100 MiB
    with gg.local_grid(1, limits=Limits(max_client_memory=1 << 20)) as grid:
        one, tests = torch.ones(1), torch.arange(5000.0)
        assert Peer(grid).request("w0", {"kind": "put", "values": [[1, one],
                                                                   [2, tests]]})["ok"]  # fmt: skip
        expand = [hostile.call("aten::expand.default", [Slot(0), [n]], [2]),
                  hostile.call("aten::expand.default", [Slot(0), [1, n]], [3]),
                  hostile.call("aten::expand.default", [Slot(0), [n, 1]], [4])]  # fmt: skip
        _refused_before_it_runs(grid, [*expand, hostile.call(op, args, outs)],
                                [1, 2, 10, 11, 12, 13, 14], 0)  # fmt: skip


def test_a_sort_of_a_dense_tensor_is_charged_its_indices_and_copies():
    # A 312 kB tensor held, and a topk of it: a copy of its values and an int64 index per
    # element inside the op (1.5 MB at its peak, measured) though its result is 8 bytes.
    with gg.local_grid(1, limits=Limits(max_client_memory=1 << 20)) as grid:
        x, small = torch.randn(80_000), torch.randn(100)
        assert Peer(grid).request("w0", {"kind": "put", "values": [[1, x], [2, small]]})["ok"]
        topk = [hostile.call("aten::topk.default", [Slot(0), 1], [1, 2])]
        _refused_before_it_runs(grid, topk, [1, 10, 11], 0)
        got = _returns(grid, [*topk, ["return", 1], ["return", 2]], [2, 20, 21])
        want = torch.topk(small, 1)
        assert torch.equal(got[0], want.values) and torch.equal(got[1], want.indices)


def test_a_convolution_is_charged_the_columns_it_unfolds_its_input_into():
    # float64 convolutions unfold each input patch into a column: a 30 x 30 kernel over a
    # 200 x 200 image is 1.2 MB of input and 288 MB of columns (measured 406 MiB).
    with gg.local_grid(1, limits=Limits(max_client_memory=8 << 20)) as grid:
        image = torch.randn(1, 1, 200, 200, dtype=torch.float64)
        kernel = torch.randn(1, 1, 30, 30, dtype=torch.float64)
        small, small_kernel = (torch.randn(1, 1, 8, 8, dtype=torch.float64),
                               torch.randn(1, 1, 3, 3, dtype=torch.float64))  # fmt: skip
        values = [[1, image], [2, kernel], [3, small], [4, small_kernel]]
        assert Peer(grid).request("w0", {"kind": "put", "values": values})["ok"]
        conv = "aten::convolution.default"
        rest = [None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1]
        steps = [hostile.call(conv, [Slot(0), Slot(1), *rest], [2]), ["return", 2]]
        _refused_before_it_runs(grid, steps[:1], [1, 2, 10], 0)
        got = _returns(grid, steps, [3, 4, 20])
        assert torch.equal(got[0], torch.ops.aten.convolution(small, small_kernel, *rest))


@pytest.mark.parametrize(
    "image, kernel",
    [  # oneDNN copies a float32 image into a layout with channels padded to 16: one of 1
        # channel took 1.2 GB, charged 134 MB (a copy of each input).
        ([1, 1, 4096, 4096], [1, 1, 3, 3]),
        # A float32 3-D convolution of one channel unfolds columns (torch picks a slow
        # kernel for it): 271 MB, charged 42 MB.
        ([1, 1, 128, 128, 128], [4, 1, 3, 3, 3]),
    ],
)  # fmt: skip
def test_a_float32_convolution_is_charged_the_copies_its_kernel_makes(image, kernel):
    spatial = len(image) - 2
    rest = [None, [1] * spatial, [1] * spatial, [1] * spatial, False, [0] * spatial, 1]
    with gg.local_grid(1, limits=Limits(max_client_memory=256 << 20)) as grid:
        values = [[1, torch.ones(1)], [2, torch.randn(kernel)]]
        assert Peer(grid).request("w0", {"kind": "put", "values": values})["ok"]
        convolution = hostile.call("aten::convolution.default", [Slot(2), Slot(1), *rest], [3])
        steps = [_expanded(0, image, 2), convolution]
        _refused_before_it_runs(grid, steps, [1, 2, 10, 11], 0)
        small = torch.randn(image[:2] + [24] * spatial)  # what fits runs as in torch
        p = gg.send(small, grid.workers[0])
        weight = torch.randn(kernel)
        got = torch.ops.aten.convolution(p, gg.send(weight, grid.workers[0]), *rest)
        assert torch.allclose(got.get(), torch.ops.aten.convolution(small, weight, *rest))


def test_a_convolution_is_checked_against_the_time_limit_by_its_multiply_adds():
    # 1 x 2048 x 128 x 128 (expanded from one number) by 2048 x 2048 x 1 x 1: 6.9 x 10^10
    # multiply-adds, taken for 3.4 x 10^7 (its largest tensor), ran 1.4 s under a 0.5 s limit.
    limits = Limits(max_client_memory=None, max_request_seconds=0.5)
    with gg.local_grid(1, limits=limits) as grid:
        values = [[1, torch.ones(1)], [2, torch.randn(2048, 2048, 1, 1)]]
        assert Peer(grid).request("w0", {"kind": "put", "values": values})["ok"]
        rest = [None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1]
        steps = [
            hostile.call("aten::expand.default", [Slot(0), [1, 2048, 128, 128]], [2]),
            hostile.call("aten::convolution.default", [Slot(2), Slot(1), *rest], [3]),
        ]
        reply = Peer(grid).request("w0", hostile.run(steps, [1, 2, 10, 11]))
        assert not reply["ok"] and "would run for" in reply["error"]["message"], reply
        assert grid.local_workers[0].sessions["mallory/s"].work.ops_run == 0


def _expanded(slot: int, shape: list[int], out: int) -> list:
    return hostile.call("aten::expand.default", [Slot(slot), shape], [out])


# Second review: scratch that grows past the inputs' own sizes (an outer product, a broadcast,
# a count per row, a batch copied out, a cast to a wider dtype). Each ran under the limit.
WIDE_SCRATCH = {
    "_trilinear: the outer product of its inputs": (
        [torch.ones(1)],
        [_expanded(0, [4096, 1], 1), _expanded(0, [4096, 1], 2),
         hostile.call("aten::_trilinear.default",
                      [Slot(1), Slot(2), Slot(2), [1], [0], [0], [1], 2], [3])],
    ),
    "huber_loss: over its inputs' broadcast shape": (
        [torch.ones(1)],
        [_expanded(0, [4096, 1], 1), _expanded(0, [1, 4096], 2),
         hostile.call("aten::huber_loss.default", [Slot(1), Slot(2), 1, 1.0], [3])],
    ),
    "dist: over its inputs' broadcast shape": (
        [torch.ones(1)],
        [_expanded(0, [4096, 1], 1), _expanded(0, [1, 4096], 2),
         hostile.call("aten::dist.default", [Slot(1), Slot(2)], [3])],
    ),
    "embedding_dense_backward: a count per row": (
        [torch.ones(2048, 0), torch.arange(0, 1 << 24, 1 << 13)],
        [hostile.call("aten::embedding_dense_backward.default",
                      [Slot(0), Slot(1), 1 << 24, -1, True], [2])],
    ),
    "_embedding_bag_backward: two counts per row, whatever scale_grad_by_freq says": (
        [torch.ones(1, 0), torch.zeros(1, dtype=torch.long), torch.ones(1, dtype=torch.long)],
        [hostile.call("aten::_embedding_bag_backward.default",
                      [Slot(0), Slot(1), Slot(1), Slot(1), Slot(2), Slot(1), 1 << 22, False, 0,
                       False, None, -1], [3])],
    ),
    "cholesky_solve: its matrix copied out to the broadcast batch": (
        [torch.eye(64), torch.ones(64, 1, 64, 1)],
        [_expanded(0, [1, 64, 64, 64], 2),
         hostile.call("aten::cholesky_solve.default", [Slot(1), Slot(2)], [3])],
    ),
    "sum: cast to the dtype it is asked for": (
        [torch.ones(1, dtype=torch.int8)],
        [_expanded(0, [1 << 22], 1),
         hostile.call("aten::sum.default", [Slot(1)], [2], {"dtype": torch.complex128})],
    ),
    "eq: cast to the inputs' common dtype": (
        [torch.ones(1, dtype=torch.int8), torch.ones(1, dtype=torch.complex128)],
        [_expanded(0, [1 << 22], 2),
         hostile.call("aten::eq.Tensor", [Slot(2), Slot(1)], [3])],
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(WIDE_SCRATCH), ids=lambda c: c.split(":")[0])
def test_scratch_past_the_inputs_own_sizes_is_refused_before_it_runs(case):
    # 64-256 MiB each, measured, under a 3 MiB limit (the eq: and 4 MiB for its bools)
    values, steps = WIDE_SCRATCH[case]
    limit = (3 << 20) + sum(v.nbytes for v in values)
    if case.startswith("eq"):
        limit += 4 << 20
    with gg.local_grid(1, limits=Limits(max_client_memory=limit)) as grid:
        put = {"kind": "put", "values": [[1 + i, v] for i, v in enumerate(values)]}
        assert Peer(grid).request("w0", put)["ok"]
        slots = [1 + i for i in range(len(values))] + [10 + i for i in range(4)]
        _refused_before_it_runs(grid, steps, slots[:4] if len(values) == 1 else slots, 0)


@pytest.mark.parametrize(
    "shape, pool",
    [  # A 512 x 512 window over a 1024 x 1024 expanded image: 2.7 x 10^11 additions, 30 s,
        # taken for 10^6 (its largest tensor) under a 0.2 s limit.
        ([1, 1, 1024, 1024], ["aten::avg_pool2d.default", [512, 512], [1, 1]]),
        # The same window given as one number (a size in every dimension): taken for 512.
        ([1, 1, 1024, 1024], ["aten::avg_pool2d.default", [512], [1]]),
        ([1, 1, 256, 256, 256], ["aten::max_pool3d_with_indices.default", [96], [1]]),
        # An adaptive pool's windows overlap: 27 elements each (3 s), taken for one (0.05 s).
        ([1, 1, 1024, 1024, 1024], ["aten::_adaptive_avg_pool3d.default", [600, 600, 600]]),
    ],
)  # fmt: skip
def test_a_pool_is_checked_against_the_time_limit_by_its_windows_elements(shape, pool):
    limits = Limits(max_client_memory=None, max_request_seconds=0.2)
    with gg.local_grid(1, limits=limits) as grid:
        assert Peer(grid).request("w0", {"kind": "put", "values": [[1, torch.ones(1)]]})["ok"]
        name, *rest = pool
        steps = [_expanded(0, shape, 1), hostile.call(name, [Slot(1), *rest], [2])]
        reply = Peer(grid).request("w0", hostile.run(steps, [1, 2, 3]))
        assert not reply["ok"] and "would run for" in reply["error"]["message"], reply
        assert grid.local_workers[0].sessions["mallory/s"].work.ops_run == 0


def test_a_search_is_charged_a_binary_search_per_element():
    # 2 x 10^8 queries in a sequence of 2^24: ~5 s, taken for 2 x 10^8 elements (0.01 s).
    limits = Limits(max_client_memory=None, max_request_seconds=0.2)
    with gg.local_grid(1, limits=limits) as grid:
        assert Peer(grid).request("w0", {"kind": "put", "values": [[1, torch.ones(1)]]})["ok"]
        search = hostile.call("aten::searchsorted.Tensor", [Slot(1), Slot(2)], [3])
        steps = [_expanded(0, [1 << 24], 1), _expanded(0, [2 * 10**8], 2), search]
        reply = Peer(grid).request("w0", hostile.run(steps, [1, 2, 3, 4]))
        assert not reply["ok"] and "would run for" in reply["error"]["message"], reply
        assert grid.local_workers[0].sessions["mallory/s"].work.ops_run == 0
        edges, values = torch.tensor([0.0, 1.0, 5.0]), torch.tensor([-1.0, 0.5, 9.0])
        got = torch.bucketize(gg.send(values, grid.workers[0]), edges)  # honest: as torch
        assert torch.equal(got.get(), torch.bucketize(values, edges))


def test_embedding_renorm_is_charged_a_norm_op_per_index():
    # It calls a norm op for each distinct index (~2 us each): 10^7 indices ran ~20 s,
    # taken for 10^7 elements (0.5 ms) under a 1 s limit.
    limits = Limits(max_client_memory=None, max_request_seconds=1)
    with gg.local_grid(1, limits=limits) as grid:
        weight, indices = torch.randn(10**7, 1), torch.randperm(10**7)
        put = {"kind": "put", "values": [[1, weight], [2, indices]]}
        assert Peer(grid).request("w0", put)["ok"]
        renorm = hostile.call("aten::embedding_renorm_.default", [Slot(0), Slot(1), 1.0, 2.0], [2])
        reply = Peer(grid).request("w0", hostile.run([renorm], [1, 2, 3]))
        assert not reply["ok"] and "would run for" in reply["error"]["message"], reply
        honest = torch.randn(10, 3) * 5  # a few rows renormalised run as in torch
        p = honest.send(grid.workers[0])
        got = torch.nn.functional.embedding(torch.tensor([1, 4]), p, max_norm=1.0)
        assert torch.equal(
            got.get(),
            torch.nn.functional.embedding(torch.tensor([1, 4]), honest.clone(), max_norm=1.0),
        )


def test_a_program_is_charged_the_memory_its_decoded_steps_hold():
    # An empty list is 1 byte on the wire and 64 in memory: a program of 200,000 of them,
    # 200 kB as sent, held 13 MB, charged its 200 kB (64 such programs are kept a session).
    # (Headers now hold at most one list per 4 bytes: lists of 3 small ints, 80 bytes each.)
    bloated = hostile.call("aten::sum.dim_IntList", [Slot(0), [[0, 0, 0]] * 60_000], [1])
    with gg.local_grid(1, limits=Limits(max_client_memory=4 << 20)) as grid:
        peer = Peer(grid)
        assert peer.request("w0", {"kind": "put", "values": [[1, torch.ones(3)]]})["ok"]
        reply = peer.request("w0", hostile.run([bloated], [1, 2]))
        assert not reply["ok"] and "memory limit" in reply["error"]["message"], reply
        assert grid.local_workers[0].sessions["mallory/s"].work.programs == {}  # not kept
        honest = hostile.call("aten::sum.dim_IntList", [Slot(0), [0]], [1])
        reply = peer.request("w0", hostile.run([honest, ["return", 1]], [1, 2], plan=2))
        assert reply["ok"] and reply["returns"][0][1].item() == 3.0


def test_transfers_from_identities_no_run_named_are_charged_to_their_sender():
    # Another peer's transfers, under keys no run of the victim takes, were charged to the
    # victim until its bye: the victim's own 64-byte put was then refused over its limit.
    # They are charged to the sender's share of the worker's memory budget (here 1 MiB).
    cap = 1 << 20
    limits = Limits(max_client_memory=cap, max_worker_memory=16 * cap, peer_shares=16)
    with gg.local_grid(1, limits=limits) as grid:
        victim, attacker = Peer(grid, "alice"), Peer(grid, "mallory")
        assert victim.request("w0", {"kind": "ping"})["ok"]
        for vid in range(1, 40):  # 64 kB each: 2.5 MB in all, over one client's budget
            transfer = {"kind": "transfer", "client": "alice/s", "run": 10**9, "src": "w1",
                        "values": [vid], "tensors": [torch.zeros(cap // 64)]}  # fmt: skip
            attacker.publish("w0", wire.encode(transfer))
        put = {"kind": "put", "values": [[1, torch.ones(cap // 8)]]}  # half its budget
        assert victim.request("w0", put)["ok"]
        worker = grid.local_workers[0]
        assert worker.sessions["alice/s"].memory() < cap * 3 // 4
        assert cap // 2 < worker.budget.held("mallory") <= cap  # the sender's share, no more
        assert victim.request("w0", {"kind": "bye"})["ok"]
        assert worker.budget.held("mallory") == 0  # released with the inbox that kept them


@pytest.mark.parametrize("isolate", [False, True], ids=["in-process", "executor"])
def test_transfers_kept_for_resending_stay_within_the_memory_limit(isolate):
    # One expanded 4-byte tensor sent to many made-up workers: each transfer is its full
    # 4 MiB once encoded, and the worker kept them all for resends (150 of 16 MiB: 2.4 GB
    # under a 64 MiB limit), while the run ran and after.
    cap = 8 << 20
    sends = [hostile.call("aten::expand", [Slot(0), [1 << 20]], [1])]
    sends += [["send", [1], f"d{i}"] for i in range(12)]
    peers = {f"d{i}": "nobody" for i in range(12)}
    with gg.local_grid(1, limits=Limits(max_client_memory=cap), isolate=isolate) as grid:
        peer = Peer(grid)
        assert peer.request("w0", {"kind": "put", "values": [[1, torch.ones(1)]]})["ok"]
        assert peer.request("w0", run(sends, [1, 2], peers=peers), timeout=60)["ok"]
        session = grid.local_workers[0].sessions["mallory/s"]
        assert 0 < len(session.sent) < 12  # the latest kept, as many as fit
        assert session.memory() <= cap


def test_pdists_backward_is_charged_by_its_points_length_not_its_gradients():
    # It was charged its gradient's length (n^2 / 2) per distance: 25 s for the backward of
    # 1,000 points' distances (3 ms in torch), refused under a 10 s limit.
    points = torch.randn(1000, 16)
    with gg.local_grid(1, limits=Limits(max_request_seconds=10)) as grid:
        p = gg.send(points, grid.workers[0]).requires_grad_(True)
        (got,) = torch.autograd.grad(torch.nn.functional.pdist(p).sum(), p)
        want = points.clone().requires_grad_(True)
        (expected,) = torch.autograd.grad(torch.nn.functional.pdist(want).sum(), want)
        assert torch.allclose(got.get(), expected)
