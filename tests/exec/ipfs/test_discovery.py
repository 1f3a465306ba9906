"""The discovery directory against a flood of announcements: what it keeps stays bounded.

Any peer may publish on the discovery topic, in the clear, as often as it likes; every
worker's and client's directory reads it. No Kubo here: the directory's handler is fed the
announcements as its transport would hand them over (sender identity, payload).
"""

from __future__ import annotations

import logging
import time
from collections import Counter

import pytest

from gridgraph.errors import GridError
from gridgraph.exec import wire
from gridgraph.exec.ipfs import discovery, secure
from gridgraph.exec.ipfs.discovery import Directory
from gridgraph.exec.safety import droplog


def announce(directory: Directory, sender: str, name: str, instance: str = "0123456789ab"):
    msg = {"kind": "announce", "name": name, "instance": instance, "lease": 300}
    directory.on_message(sender, wire.encode(msg))


def counted_right(directory: Directory) -> bool:
    """Whether the directory's names per node are those of its names."""
    held = Counter(secure.peer_of(s.identity) for s in directory._seen.values())
    return directory._names_of == dict(held)


def identity(peer: str, n: int = 0) -> str:
    """An endpoint identity on node `peer` (a node makes keys at will)."""
    return secure.make_identity(peer, n.to_bytes(secure.KEY_BYTES, "big"))


def test_one_node_announcing_names_without_end_holds_a_bounded_share():
    # Every name announced was kept for ever: 50 announcements held 48 MiB (instances of
    # 1 MB), and one node's made-up names grew every directory without bound.
    directory = Directory()
    flooder = identity("12D3KooWflood")
    for i in range(3 * discovery.SEEN_KEPT):
        announce(directory, flooder, f"n{i}")
    assert len(directory._seen) <= discovery.SEEN_KEPT
    assert len(directory.live()) <= discovery.SEEN_KEPT // 2 + discovery.NAMES_PER_PEER
    worker = identity("12D3KooWworker")
    announce(directory, worker, "w0")  # a real worker still joins the grid
    assert directory.identity("w0") == worker and directory.alive("w0")
    assert counted_right(directory)


def test_silent_names_make_room_and_pinned_ones_stay():
    directory = Directory(dead_after=0.2)
    worker = identity("12D3KooWworker")
    announce(directory, worker, "w0")
    # (as a grid connects: pinned in the same hold of the lock that saw it alive; pinned
    # after, a full directory dropping silent names in between raised KeyError there)
    assert directory.wait(names=["w0"], timeout=1, pin=True) == ["w0"]
    for i in range(discovery.SEEN_KEPT):  # from many nodes: each under its share
        announce(directory, identity(f"12D3KooWnode{i // 32}"), f"n{i}")
    assert len(directory._seen) == discovery.SEEN_KEPT and counted_right(directory)
    time.sleep(1.1)  # all silent now, and the last look for silent names a second ago
    announce(directory, identity("12D3KooWlate"), "late")
    assert set(directory._seen) == {"w0", "late"} and counted_right(directory)
    announce(directory, identity("12D3KooWother"), "w0")  # a silent name taken over
    assert directory.identity("w0") == worker  # (pinned: still the one connected to)
    assert directory._seen["w0"].identity == identity("12D3KooWother")
    assert counted_right(directory)


def test_an_announcement_with_a_long_instance_is_ignored():
    directory = Directory()
    announce(directory, identity("12D3KooWflood"), "w0", instance="x" * (512 << 10))
    assert directory.identity("w0") is None
    announce(directory, identity("12D3KooWworker"), "w0")
    assert directory.alive("w0")


def test_claims_by_untrusted_or_rival_peers_are_remembered_boundedly(caplog):
    # Each (name, sender identity) warned about was remembered, and a node makes keys at
    # will: 20,000 claims held 6 MiB, without end. A bad name was logged whole.
    directory = Directory(trust={"w0": "12D3KooWtrusted"})
    for n in range(3 * droplog.KEPT):
        announce(directory, identity(f"12D3KooWflood{n}"), "w0")
    assert len(directory._drops._last) <= droplog.KEPT
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="gridgraph.ipfs"):
        for i in range(100):  # names are free too: logged once per node
            announce(directory, identity("12D3KooWflood"), f"n{i}")
    assert caplog.text.count("not trusted") <= 1
    caplog.clear()
    directory = Directory()  # (the lines for 10 s are spent: a fresh log's)
    with caplog.at_level(logging.WARNING, logger="gridgraph.ipfs"):
        announce(directory, identity("12D3KooWflood"), "bad name " + "x" * (512 << 10))
    assert "bad worker name" in caplog.text
    assert max(len(r.getMessage()) for r in caplog.records) < 1000


def test_a_mistyped_worker_name_fails_fast_saying_did_you_mean():
    directory = Directory()
    for name in ("w1", "worker1"):
        announce(directory, identity("12D3KooWgood"), name)
    start = time.monotonic()
    try:
        directory.wait(names=["W1", "wokrer1"], timeout=60)
    except discovery.GridError as e:
        error = str(e)
    took = time.monotonic() - start
    assert took < discovery.TYPO_AFTER + 1  # before: the whole 60 s
    assert "did you mean 'w1', 'worker1'?" in error and "'W1', 'wokrer1'" in error


def test_a_name_that_may_still_be_starting_is_waited_for_then_suggested():
    directory = Directory()
    announce(directory, identity("12D3KooWgood"), "worker1")
    start = time.monotonic()
    try:
        directory.wait(names=["worker2"], timeout=3)  # a sibling, not a typo
    except discovery.GridError as e:
        error = str(e)
    assert time.monotonic() - start >= 3
    assert "Did you mean 'worker1' for 'worker2'?" in error


def test_typo_of_points_at_typos_not_at_siblings():
    live = ["w0", "w1", "worker1", "node-a"]
    typos = {"W1": "w1", "wokrer1": "worker1", "wrker1": "worker1", "node_a": "node-a"}
    for name, meant in typos.items():
        assert discovery.typo_of(name, live) == meant, name
    for sibling in ("w2", "w10", "w01", "worker2", "node-b", "wk"):
        assert discovery.typo_of(sibling, live) is None, sibling


def test_a_name_two_live_peers_claim_is_not_picked_but_named_with_both():
    # A peer announcing "w0" 20 times a second: a fresh client resolved w0 to it 3 times out
    # of 3 ("first announcement heard wins"), and the impostor received the client's tensor.
    directory = Directory()
    announce(directory, identity("12D3KooWimpostor"), "w0")
    announce(directory, identity("12D3KooWworker"), "w0")
    with pytest.raises(GridError) as error:
        directory.wait(names=["w0"], timeout=1.0, pin=True)
    assert "12D3KooWimpostor" in str(error.value) and "12D3KooWworker" in str(error.value)
    assert "trust=" in str(error.value)
    with pytest.raises(GridError, match="Left out, each claimed by two peers: w0"):
        directory.wait(min_workers=1, timeout=1.0, pin=True)  # asked for no names: not picked


def test_asked_for_no_names_a_client_leaves_out_a_name_two_peers_claim_and_takes_the_rest():
    # A hijacked name on an open grid must not make every `connect(min_workers=...)` fail:
    # it is left out (never picked silently), and the other workers are used.
    directory = Directory()
    announce(directory, identity("12D3KooWimpostor"), "w0")
    announce(directory, identity("12D3KooWworker"), "w0")
    announce(directory, identity("12D3KooWother"), "w1")
    assert directory.wait(min_workers=1, timeout=1.0, pin=True) == ["w1"]
    assert secure.peer_of(directory.identity("w1")) == "12D3KooWother"


def test_with_trust_the_trusted_claimant_is_picked():
    directory = Directory(trust={"w0": "12D3KooWworker"})
    announce(directory, identity("12D3KooWimpostor"), "w0")
    announce(directory, identity("12D3KooWworker"), "w0")
    announce(directory, identity("12D3KooWimpostor"), "w0")
    assert directory.wait(names=["w0"], timeout=1.0, pin=True) == ["w0"]
    assert secure.peer_of(directory.identity("w0")) == "12D3KooWworker"


def test_a_client_that_pinned_a_name_keeps_its_worker_when_a_rival_claims_it():
    directory = Directory()
    worker = identity("12D3KooWworker")
    announce(directory, worker, "w0")
    assert directory.wait(names=["w0"], timeout=1.0, pin=True) == ["w0"]
    announce(directory, identity("12D3KooWimpostor"), "w0")
    assert directory.wait(names=["w0"], timeout=1.0, pin=True) == ["w0"]
    assert directory.identity("w0") == worker and directory.alive("w0")


def test_a_rival_silent_for_dead_after_no_longer_contests_a_name():
    directory = Directory(dead_after=0.2)
    announce(directory, identity("12D3KooWgone"), "w0")
    announce(directory, identity("12D3KooWworker"), "w0")  # a rival while the first is live
    time.sleep(0.3)
    announce(directory, identity("12D3KooWworker"), "w0")  # the first is silent: it takes it
    assert directory.wait(names=["w0"], timeout=1.0, pin=True) == ["w0"]
    assert secure.peer_of(directory.identity("w0")) == "12D3KooWworker"


def test_a_message_opened_from_a_pinned_worker_keeps_it_alive():
    directory = Directory(dead_after=0.3)
    worker = identity("12D3KooWworker")
    announce(directory, worker, "w0")
    directory.wait(names=["w0"], timeout=1.0, pin=True)
    for _ in range(4):  # no heartbeat for 0.6 s: its replies say it is alive
        time.sleep(0.15)
        directory.heard(worker)
        directory.heard(identity("12D3KooWother"))
    assert directory.alive("w0")
    time.sleep(0.35)
    assert not directory.alive("w0")
