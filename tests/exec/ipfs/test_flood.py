"""One outsider Kubo node floods the grid while a client that trusts its workers computes
(real Kubo daemons, real worker processes), and an outsider claims a live worker's name.

The flood (issue 34): ~0.9 MB messages whose header is ~900k empty lists, 20 a second on the
discovery topic (announcements under the outsider's own key, as any peer may send) and 20 a
second on w1's topic (sealed for w1, as any peer of an open grid can), plus the same bytes
unsealed. Before, every client and worker decoded each (~80 ms holding the lock) before any
check: the trusted client lost w1 16-26 s into the flood, its p95 went from 16 ms to 983 ms.
"""

from __future__ import annotations

import time

import pytest
import torch

import gridgraph as gg
from gridgraph.errors import GridError
from gridgraph.exec import wire
from gridgraph.exec.ipfs import secure
from gridgraph.exec.ipfs.swarm import NodeInfo
from gridgraph.exec.ipfs.transport import (
    DISCOVERY_BURST,
    DISCOVERY_RATE,
    MAX_ANNOUNCEMENT,
    GridTransport,
)
from gridgraph.exec.protocol import DISCOVERY_TOPIC
from tests.exec.flood import (
    LineCounter,
    announcing,
    finish,
    latencies,
    p95,
    start_outsider,
)
from tests.exec.ipfs.fixtures import WorkerProcess

pytestmark = pytest.mark.ipfs

FLOOD_SECONDS = 20.0


def test_a_flood_from_an_outsider_node_leaves_a_trusted_client_its_workers_and_pace(
    kubo_nodes: list[NodeInfo], ipfs_workers: list[WorkerProcess], outsider_node: NodeInfo
):
    trust = {"w0": kubo_nodes[0].peer_id, "w1": kubo_nodes[1].peer_id}
    with gg.connect(ipfs=kubo_nodes[0].api, workers=["w0", "w1"], trust=trust,
                    timeout=30) as grid:  # fmt: skip
        w0, w1 = grid.workers
        a = torch.randn(64, 64)
        x, y = grid.send(a, w0), grid.send(a, w1)

        def step() -> None:  # a product across the two nodes, back to the client
            assert torch.equal((x @ y).sum().get(), (a @ a).sum())

        latencies(step, 2.0)  # (warm)
        before = latencies(step, 5.0)
        w1_log = next(w for w in ipfs_workers if w.name == "w1").log
        w1_lines = len(w1_log.read_text(errors="replace").splitlines())
        outsider = start_outsider(
            outsider_node.api, grid.client.identity_of("w1"), "w1", FLOOD_SECONDS
        )
        with LineCounter() as client_lines:
            try:
                during = latencies(step, FLOOD_SECONDS)  # WorkerLost would fail it here
            finally:
                sent, failed = finish(outsider)
        print(
            f"flood: {sent} messages of 0.9 MB in {FLOOD_SECONDS:g} s ({failed} failed); "
            f"p95 {1e3 * p95(before):.1f} ms before, {1e3 * p95(during):.1f} ms during"
        )
        # (20 big messages a second on each topic are asked for; on a small shared machine
        # the outsider's own node publishes some 15 in all: bench/bench_flood.py says how many)
        # (the latency target, p95 during <= 3x before, is a ratio to measure on a quiet
        # machine: bench/bench_flood.py prints it; a test asserts what must hold anywhere)
        assert sent >= 10 * FLOOD_SECONDS, (sent, failed)
        assert grid.client.alive("w1")
        # Logs bounded: the client hears nothing of it (it opens nothing from the outsider);
        # w1 logs a few lines per 10 s, not one per message.
        assert client_lines.count <= 5, client_lines.first
        grown = len(w1_log.read_text(errors="replace").splitlines()) - w1_lines
        assert grown <= 2 * 20 * FLOOD_SECONDS / 10, grown


@pytest.fixture
def impostor(outsider_node: NodeInfo, ipfs_workers):
    """The outsider announces itself as w1, a few times a second, as any peer may."""
    with announcing(outsider_node.api, "w1", "evil"):
        time.sleep(1.0)
        yield outsider_node.peer_id


def test_a_name_two_live_peers_claim_is_refused_naming_both(kubo_nodes, impostor):
    # Before, a fresh connect(workers=["w0"]) resolved w0 to a peer announcing it 20 times a
    # second, 3 times out of 3, and the impostor received the client's tensor.
    for _ in range(2):
        with pytest.raises(GridError) as error:
            gg.connect(ipfs=kubo_nodes[0].api, workers=["w1"], timeout=20)
        assert impostor in str(error.value) and kubo_nodes[1].peer_id in str(error.value)
        assert "trust=" in str(error.value)


def test_with_trust_the_claimed_name_is_the_trusted_worker(kubo_nodes, impostor):
    trust = {"w1": kubo_nodes[1].peer_id}
    with gg.connect(ipfs=kubo_nodes[0].api, workers=["w1"], trust=trust, timeout=20) as grid:
        assert secure.peer_of(grid.client.identity_of("w1")) == kubo_nodes[1].peer_id
        a = torch.randn(8)
        assert torch.equal((a.send(grid.workers[0]) * 2).get(), a * 2)


def test_the_discovery_topic_takes_from_each_node_a_bounded_rate_of_small_messages(
    kubo_nodes, outsider_node
):
    # The discovery topic is open to every peer: each of its messages was decoded, however
    # large and however many, before anyone looked at who sent it.
    listener = GridTransport(kubo_nodes[0].api)
    heard: list[bytes] = []
    listener.subscribe(DISCOVERY_TOPIC, lambda sender, payload: heard.append(payload))
    outsider = GridTransport(outsider_node.api)
    try:
        outsider.wait_for_peers(DISCOVERY_TOPIC, 1)  # (the listener's node, at least)
        msg = {"kind": "announce", "name": "spam", "instance": "x", "lease": 300.0}
        big = {**msg, "pad": "x" * (2 * MAX_ANNOUNCEMENT)}
        start = time.monotonic()
        for seq in range(4):
            outsider.publish(DISCOVERY_TOPIC, wire.encode({**big, "seq": seq}), False)
        n = 400
        for seq in range(n):
            outsider.publish(DISCOVERY_TOPIC, wire.encode({**msg, "seq": seq}), False)
        elapsed = time.monotonic() - start
        time.sleep(2.0)  # (the rest arrive)
        allowed = DISCOVERY_BURST + DISCOVERY_RATE * (elapsed + 2.0)
        assert allowed < n, "the outsider published too slowly to test anything"
        assert DISCOVERY_BURST // 2 <= len(heard) <= allowed, (len(heard), allowed)
        assert all(len(p) < MAX_ANNOUNCEMENT for p in heard)  # none of the large ones
        stream = listener._streams[DISCOVERY_TOPIC]
        assert stream.skipped >= 3  # (read but not parsed; PubSub may lose one)
    finally:
        outsider.close()
        listener.close()
