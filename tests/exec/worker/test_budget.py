"""A worker's network process stays within its memory budget whatever its peers send.

Measured on main before the budget: one peer filled its 16 sessions' request queues behind a
blocking `recv`, and the network process grew 509 MiB under a 16 MiB client limit (each
session's queue was bounded, not the peer, nor the process); stray transfers added up to the
client limit per sending node. Here eight peers, each with its own identity, do that at once.
"""

from __future__ import annotations

import pytest
import torch

import gridgraph as gg
from gridgraph.exec.safety import budget as budget_module
from gridgraph.exec.safety.budget import QUEUED_BYTES, MemoryBudget
from gridgraph.exec.safety.limits import RECORD_BYTES, TRANSFER_BYTES, GiB, Limits, machine_memory
from gridgraph.exec.worker import session as session_module
from tests.exec.hostile import run
from tests.exec.local_peer import Peer
from tests.exec.worker.arena import local_arena
from tests.exec.worker.flood import MiB, flood, local_worker, rss

CAP = 32 * MiB  # the target's network process; 16 shares of 2 MiB


@pytest.fixture
def arena():
    yield from local_arena(max_worker_memory=CAP, max_request_seconds=60.0)


def test_eight_peers_flooding_a_worker_stay_within_its_cap_and_the_victim_is_served(arena):
    worker = local_worker(arena)
    arena.check()
    before, accounted_before = rss(), worker.budget.held()
    # 144 MiB sent: puts queued behind recvs, and stray transfers
    attack = flood(arena, peers=8, size=MiB // 2)
    try:
        grown, accounted = rss() - before, worker.budget.held()
        shares = {p.transport.identity: worker.budget.held(p.transport.identity)
                  for p in attack.attackers}  # fmt: skip
        print(
            f"cap {CAP >> 20} MiB: accounted {accounted / MiB:.1f} MiB, RSS grew "
            f"{grown / MiB:.1f} MiB, {attack.sent >> 20} MiB sent"
        )
        assert accounted_before < accounted <= CAP
        assert all(0 < held <= worker.budget.share for held in shares.values()), shares
        assert grown < 2 * CAP  # (what malloc keeps aside: 144 MiB without the budget)
        assert {r["error"]["code"] for r in attack.refusals} == {"limit"}
        assert len(attack.refusals) >= 8  # each peer was told past its share
        arena.check()  # served while the flood holds
        message = attack.refusals[0]["error"]["message"]
        assert "share" in message and "max_worker_memory" in message, message
    finally:
        attack.stop()
    arena.check()


def test_what_a_peer_is_charged_goes_back_when_its_sessions_end(arena):
    worker = local_worker(arena)
    attack = flood(arena, peers=2, sessions=2)
    assert worker.budget.held() > 2 * MiB  # (1 MiB each: their shares)
    attack.stop()
    client = arena.victim.client
    victim = worker.sessions[f"{client.transport.identity}/{client.session}"]
    for peer in attack.attackers:
        for _, session in [s for s in attack.sessions if s[0] is peer]:
            assert peer.request(arena.target, {"kind": "bye", "session": session})["ok"]
        # All but what it sent to the victim's session: charged to it while that is kept.
        me = peer.transport.identity
        left = sum(len(victim.inbox[key][me]) + TRANSFER_BYTES for key, who in victim.stray
                   if who == me)  # fmt: skip
        assert worker.budget.held(me) == left > 0
    arena.check()


def test_a_budget_grants_each_peer_its_share_and_never_more_than_the_cap():
    budget = MemoryBudget(160, shares=4)  # shares of 40 bytes
    assert budget.charge("a", 40) and not budget.charge("a", 1)
    assert budget.charge("b", 30) and budget.charge("c", 40) and budget.charge("d", 40)
    assert budget.held() == 150 and not budget.charge("e", 11)  # the cap
    assert "cap" in str(budget.refusal("e", 11, "this")) and budget.charge("e", 10)
    assert "past its share of this worker's memory, 40 bytes" in str(
        budget.refusal("a", 1, "this request")
    )
    budget.release("a", 40)
    assert not budget.charge("b", 5, within=32) and budget.charge("b", 2, within=32)
    assert budget.held("a") == 0 and budget.held() == 122 and budget.peers() == 4
    budget.release("b", 1000)  # more than it holds: never below zero
    assert budget.held() == 90 and budget.held("b") == 0
    assert not budget.charge("c", 5) and budget.charge("c", 5, beyond=5)  # (past its share)
    assert not budget.charge("c", 1, beyond=5) and budget.held("c") == 45
    assert not budget.charge("f", 70, beyond=1000)  # never past the cap
    unlimited = MemoryBudget(None)
    assert unlimited.charge("a", 1 << 60) and unlimited.fits("a", 1 << 60)
    with pytest.raises(ValueError, match="positive"):
        MemoryBudget(0)


def test_gridgraph_worker_takes_its_network_process_cap():
    from gridgraph.cli import parser

    args = ["worker", "--ipfs", "/ip4/127.0.0.1/tcp/5001", "--name", "w1"]
    assert parser().parse_args([*args, "--max-worker-memory", "2GiB"]).max_worker_memory == 2 << 30
    default = parser().parse_args(args).max_worker_memory
    assert default == Limits().max_worker_memory == machine_memory() // 4
    assert Limits.unlimited().max_worker_memory is None  # (what gg.local_grid uses)


def test_transfers_a_session_sent_are_kept_for_resending_only_within_its_peers_share():
    # A session's runs can send large transfers to an identity that never takes them; each
    # is kept for a resend in the network process, up to the client's memory limit per
    # session: 16 sessions per peer of it.
    with gg.local_grid(2, limits=Limits(max_worker_memory=16 * MiB)) as grid:  # 1 MiB shares
        worker, peer = grid.local_workers[0], Peer(grid)
        assert peer.request("w0", {"kind": "put", "values": [[1, torch.zeros(1 << 16)]]})["ok"]
        for run_id in range(1, 9):  # 256 KiB each, 2 MiB in all
            sends = run([["send", [0], "w1"]], [1], run_id=run_id, peers={"w1": "nobody"})
            assert peer.request("w0", sends)["ok"]
        session = worker.sessions["mallory/s"]
        kept = sum(len(payload) for _, payload, _ in session.sent.values())
        assert 0 < kept <= worker.budget.held("mallory") <= worker.budget.share
        assert 0 < len(session.sent) < 8  # the oldest went first
        assert max(session.sent)[0] == 8  # (key: run, value, worker)
        assert peer.request("w0", {"kind": "bye"})["ok"]
        assert worker.budget.held("mallory") == 0


def test_replies_kept_for_resending_go_oldest_first_past_the_peers_share():
    # Replies kept until acknowledged were held whatever the peer's share: a client that
    # never acknowledges made the network process keep 64 MiB of replies per session.
    with gg.local_grid(1, limits=Limits(max_worker_memory=16 * MiB)) as grid:  # 1 MiB shares
        worker, peer = grid.local_workers[0], Peer(grid)
        assert peer.request("w0", {"kind": "put", "values": [[1, torch.zeros(1 << 16)]]})["ok"]
        rids = [f"r{i}" for i in range(12)]
        for i, rid in enumerate(rids):  # 256 KiB each, 3 MiB in all, none acknowledged
            reply = peer.request("w0", run([["return", 0]], [1], run_id=i + 1), rid=rid)
            assert torch.equal(reply["returns"][0][1], torch.zeros(1 << 16))
        session = worker.sessions["mallory/s"]
        kept = [rid for rid in rids if session.records[rid].reply is not None]
        assert 0 < len(kept) < 4 and kept == rids[-len(kept) :]  # the oldest went first
        assert session.records["r0"].dropped == session_module.OVER_BUDGET
        assert 3 * 256 * 1024 < worker.budget.held("mallory") <= worker.budget.share
        again = peer.request("w0", run([["return", 0]], [1], run_id=12), rid="r11")
        assert torch.equal(again["returns"][0][1], torch.zeros(1 << 16))  # the latest: kept
        assert peer.request("w0", {"kind": "bye"})["ok"]
        assert worker.budget.held("mallory") == 0


def test_a_client_past_its_peers_share_gets_an_error_saying_which_limit_and_what_to_do():
    with gg.local_grid(1, limits=Limits(max_worker_memory=16 * MiB)) as grid:  # 1 MiB shares
        with pytest.raises(gg.RemoteError, match=r"share of this worker's memory, 1\.0 MiB"):
            torch.zeros(1 << 19).send(grid.workers[0])  # 2 MiB
        small = torch.arange(4.0)
        assert torch.equal((small.send(grid.workers[0]) * 2).get(), small * 2)  # goes on


def test_a_worker_whose_shares_are_under_its_largest_message_says_so(caplog):
    MemoryBudget.of(Limits(max_worker_memory=256 * MiB, max_message_bytes=16 * MiB))
    assert not caplog.records  # shares of 16 MiB: a 16 MiB message fits
    MemoryBudget.of(Limits(max_worker_memory=64 * MiB, max_message_bytes=16 * MiB))
    [warning] = caplog.records
    text = warning.getMessage()
    assert "4.0 MiB" in text and "16.0 MiB" in text and "--max-worker-memory to 256.0 MiB" in text


def test_on_a_small_machine_the_default_share_takes_the_largest_message(monkeypatch, caplog):
    """8 GiB: the default cap is 2 GiB, cap / 16 = 128 MiB, under the 256 MiB max_message_bytes;
    a peer's share is raised to hold one such message (the cap still bounds all peers)."""
    monkeypatch.setattr(budget_module, "machine_memory", lambda: 8 * GiB)
    limits = Limits(max_worker_memory=8 * GiB // 4)  # what Limits() makes on that machine
    budget = MemoryBudget.of(limits)
    assert budget.cap == 2 * GiB and not caplog.records
    message = limits.max_message_bytes
    assert budget.charge("alice", message + QUEUED_BYTES + RECORD_BYTES)  # a whole request
    assert not budget.charge("alice", budget.share)  # still one share, within the cap
    hand_set = MemoryBudget.of(Limits(max_worker_memory=1 * GiB))  # set by hand: as given
    assert hand_set.share == 64 * MiB and "max_message_bytes" in caplog.text
