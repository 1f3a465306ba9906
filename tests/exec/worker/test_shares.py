"""Executor places go to peers in fair shares, not to whoever asks first.

Measured on main: four peers x 16 sessions took all 64 executor places, each kept by a
ping now and then until its lease ended, and every other client's first request was
refused. Here, with 4 places: a peer alone takes 2 (half, one share left for a newcomer),
and when a late peer finds none free, the idle session of the peer holding the most that
stores nothing gives its place up (re-forked on its next request, nothing lost); a session
that stores tensors never does.
"""

from __future__ import annotations

import torch

import gridgraph as gg
from gridgraph.exec.safety.limits import Limits
from tests.exec.local_peer import Peer

LIMITS = Limits(max_executors=4, sessions_per_peer=4)


def _fork(peer, session: str, keep: bool) -> dict:
    """A put that starts the session's executor; freed again unless `keep`."""
    reply = peer.request("w0", {"kind": "put", "session": session, "values": [[1, torch.ones(4)]]})
    if reply["ok"] and not keep:
        assert peer.request("w0", {"kind": "free", "session": session, "free": [1]})["ok"]
    return reply


def test_a_late_peer_gets_a_place_from_the_peer_holding_most_without_losing_anything():
    with gg.local_grid(1, limits=LIMITS, isolate=True) as grid:
        worker = grid.local_workers[0]
        hoarder, keeper = Peer(grid, "hoarder"), Peer(grid, "keeper")
        late, later = Peer(grid, "late"), Peer(grid, "later")
        assert _fork(hoarder, "a", keep=False)["ok"] and _fork(hoarder, "b", keep=False)["ok"]
        refused = _fork(hoarder, "c", keep=False)  # past its share: places left for others
        assert not refused["ok"] and "fair share" in refused["error"]["message"], refused
        assert _fork(keeper, "k", keep=True)["ok"]  # stores a tensor
        x = torch.arange(4.0).send(grid.workers[0])  # the grid's own client: all 4 held
        assert _fork(late, "l", keep=True)["ok"]  # in the place the hoarder's "a" gave up
        assert worker.sessions["hoarder/a"].executor is None  # (its session is kept)
        assert hoarder.request("w0", {"kind": "ping", "session": "a"})["ok"]
        again = _fork(hoarder, "a", keep=False)  # re-forked only within its share
        assert not again["ok"] and "fair share" in again["error"]["message"], again
        full = _fork(later, "m", keep=True)  # each peer holds one: none gives it up
        assert not full["ok"] and "max_executors" in full["error"]["message"], full
        assert worker.sessions["hoarder/b"].executor is not None
        back = keeper.request("w0", {"kind": "run", "run": 1, "plan": 1, "slots": [1],
                                     "params": [], "session": "k",
                                     "program": [[["return", 0]]]})  # fmt: skip
        assert torch.equal(back["returns"][0][1], torch.ones(4))
        assert torch.equal((x + 1).get(), torch.arange(4.0) + 1)
        for peer in (hoarder, keeper, late, later):
            peer.close()


def test_a_session_storing_only_empty_tensors_keeps_its_place():
    """An empty tensor holds no bytes, but it is the client's value: a session storing one
    is not idle-and-empty, and its executor must not be given to another peer."""
    with gg.local_grid(1, limits=LIMITS, isolate=True) as grid:
        hoarder, late = Peer(grid, "hoarder"), Peer(grid, "late")
        empty = {"kind": "put", "session": "a", "values": [[1, torch.ones(0, 3)]]}
        assert hoarder.request("w0", empty)["ok"]
        assert _fork(hoarder, "b", keep=False)["ok"]
        assert _fork(Peer(grid, "keeper"), "k", keep=True)["ok"]
        x = torch.arange(4.0).send(grid.workers[0])  # all 4 places held
        _fork(late, "l", keep=True)  # may take "b"'s place, never "a"'s
        back = hoarder.request("w0", {"kind": "run", "run": 1, "plan": 1, "slots": [1],
                                      "params": [], "session": "a",
                                      "program": [[["return", 0]]]})  # fmt: skip
        assert back["ok"], back["error"]
        assert back["returns"][0][1].shape == (0, 3)
        assert torch.equal((x + 1).get(), torch.arange(4.0) + 1)
        for peer in (hoarder, late):
            peer.close()


def test_a_peer_starting_many_sessions_at_once_gets_no_more_than_its_share():
    """Each first request is served on its session's own thread, and an executor takes a
    while to start: places being started count, or all of them pass the share check at
    once."""
    limits = Limits(max_executors=8, sessions_per_peer=8)
    with gg.local_grid(1, limits=limits, isolate=True) as grid:
        worker, hoarder = grid.local_workers[0], Peer(grid, "hoarder")
        put = {"kind": "put", "values": [[1, torch.ones(4)]]}
        rids = [hoarder.send("w0", {**put, "session": s}) for s in "abcdefgh"]  # at once
        replies = {}
        while len(replies) < len(rids):  # (in any order: `reply` drops the others')
            reply = hoarder.replies.get(timeout=60)
            replies[reply["re"]] = reply
        replies = list(replies.values())
        started = [s for s in worker.sessions.values() if s.executor is not None]
        assert len(started) == sum(r["ok"] for r in replies) <= 4, replies  # 8 // (1 + 1)
        hoarder.close()
