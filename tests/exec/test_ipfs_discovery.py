"""The discovery directory against a flood of announcements: what it keeps stays bounded.

Any peer may publish on the discovery topic, in the clear, as often as it likes; every
worker's and client's directory reads it. No Kubo here: the directory's handler is fed the
announcements as its transport would hand them over (sender identity, payload).
"""

from __future__ import annotations

import logging

from gridgraph.exec import secure, wire
from gridgraph.exec.ipfs import discovery
from gridgraph.exec.ipfs.discovery import Directory


def announce(directory: Directory, sender: str, name: str, instance: str = "0123456789ab"):
    msg = {"kind": "announce", "name": name, "instance": instance, "lease": 300}
    directory.on_message(sender, wire.encode(msg))


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
    for n in range(3 * discovery.WARNED_KEPT):
        announce(directory, identity("12D3KooWflood", n), "w0")
    assert len(directory._warned) <= discovery.WARNED_KEPT
    with caplog.at_level(logging.WARNING, logger="gridgraph.ipfs"):
        announce(directory, identity("12D3KooWflood"), "bad name " + "x" * (512 << 10))
    assert "bad worker name" in caplog.text
    assert max(len(r.getMessage()) for r in caplog.records) < 1000
