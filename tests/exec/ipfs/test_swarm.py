"""Starting a local swarm: each node is handed on as soon as its own API answers; a worker
keeps what it loaded at start out of the collector's sight."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gridgraph.exec.ipfs.kubo import Kubo
from gridgraph.exec.ipfs.swarm import find_ipfs_binary, start_nodes, stop_nodes

pytestmark = pytest.mark.ipfs


def test_each_node_is_handed_on_once_its_api_answers_and_again_when_reused(tmp_path):
    try:
        find_ipfs_binary()
    except FileNotFoundError as error:
        pytest.skip(str(error))
    answered = []  # (index, the peer ID its API gave inside the callback)

    def on_ready(node):
        answered.append((node.index, Kubo(node.api, timeout=5.0).id()))

    try:
        nodes = start_nodes(2, tmp_path, on_ready=on_ready)
        assert sorted(answered) == sorted((node.index, node.peer_id) for node in nodes)
        answered.clear()
        assert start_nodes(2, tmp_path, on_ready=on_ready) == nodes  # the running swarm
        assert answered == [(node.index, node.peer_id) for node in nodes]
        assert Kubo(nodes[0].api).swarm_peers() == [nodes[1].peer_id]
    finally:
        stop_nodes(tmp_path)


def test_a_worker_once_up_keeps_what_it_loaded_out_of_the_collectors_sight(kubo_nodes):
    # In a process of its own: freezing is for the whole process, and this one runs tests.
    code = (
        "import gc, threading, sys\n"
        "from gridgraph.exec.ipfs.worker_main import run_worker\n"
        "stop = threading.Event()\n"
        "threading.Timer(0.5, stop.set).start()\n"
        "assert gc.get_freeze_count() == 0\n"
        "run_worker(sys.argv[1], 'frozen', stop=stop, isolate=False, heartbeat=0.1)\n"
        "print(gc.get_freeze_count())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, kubo_nodes[0].api], capture_output=True, text=True,
        timeout=120, check=True,
    )  # fmt: skip
    assert int(out.stdout) > 100_000  # torch's modules and functions, not a handful
