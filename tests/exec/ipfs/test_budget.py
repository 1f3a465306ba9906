"""A real `gridgraph worker --max-worker-memory 32MiB` under a flood from one Kubo node that
makes eight client keys: the keys share their node's share of the budget (a key costs
nothing to make; the node that signs is the peer), the worker's network process stays under
its cap, and a client on another node keeps being served, exactly."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

import gridgraph as gg
from gridgraph.exec.ipfs.discovery import discover
from gridgraph.exec.ipfs.swarm import stop_worker
from gridgraph.exec.protocol import worker_topic
from tests.exec.hostile import Peer
from tests.exec.ipfs.fixtures import sealed_endpoint
from tests.exec.worker.arena import Arena
from tests.exec.worker.flood import MiB, flood

pytestmark = pytest.mark.ipfs

CAP = 32 * MiB  # shares of 2 MiB


@pytest.fixture
def capped(kubo_nodes, tmp_path: Path):
    log = tmp_path / "capped.log"
    args = [sys.executable, "-m", "gridgraph", "worker", "--ipfs", kubo_nodes[1].api,
            "--name", "capped", "--max-worker-memory", f"{CAP >> 20}MiB",
            "--log-level", "WARNING"]  # fmt: skip
    with open(log, "ab") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
    try:
        discover(kubo_nodes[0].api, names=["capped"], timeout=90, procs=[proc])
        yield proc, log
    finally:
        stop_worker(proc)


def test_eight_keys_of_one_node_flooding_a_worker_stay_within_its_cap(
    kubo_nodes, outsider_node, capped
):
    proc, log = capped
    peers: list[Peer] = []

    def new_peer(name: str) -> Peer:
        transport = sealed_endpoint(outsider_node.api)
        transport.wait_for_peers(worker_topic("capped"), 1, timeout=30)
        peers.append(Peer(transport, session=f"{name}-{uuid.uuid4().hex[:8]}", resend=1.0))
        return peers[-1]

    with gg.connect(ipfs=kubo_nodes[0].api, workers=["capped"], timeout=60) as grid:
        arena = Arena("ipfs", grid, new_peer("mallory"), "capped", "capped",
                      lambda: proc.poll() is None, new_peer)  # fmt: skip
        try:
            arena.check()
            worker = psutil.Process(proc.pid)
            before = worker.memory_info().rss
            attack = flood(arena, peers=8, sessions=1, queued=8, strays=4, size=MiB)
            time.sleep(3)  # (the payloads in flight fetched)
            grown = worker.memory_info().rss - before
            print(f"cap {CAP >> 20} MiB: worker RSS grew {grown / MiB:.1f} MiB, "
                  f"{attack.sent >> 20} MiB sent from 8 keys of one node")  # fmt: skip
            arena.check()  # served while the flood holds
            assert grown < 2 * CAP  # (what malloc keeps aside)
            assert "max_worker_memory" in log.read_text(errors="replace")  # refused, said why
            attack.stop()
            arena.check()
        finally:
            for peer in peers:
                peer.close()
