"""Starting a local swarm: each node is handed on as soon as its own API answers; a worker
keeps what it loaded at start out of the collector's sight."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gridgraph.exec.ipfs import swarm
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


def test_a_node_whose_api_port_another_daemon_took_is_not_handed_on(kubo_nodes, tmp_path):
    # The ports are picked free, then bound by the daemon: another swarm starting at the same
    # time may take one in between. Its daemon must not be taken for ours (a worker started
    # on it would join that other swarm).
    taken = int(kubo_nodes[0].api.rsplit("/", 1)[1])
    handed_on, free_ports = [], swarm._free_ports
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(swarm, "_free_ports", lambda count: [taken, *free_ports(count)[1:]])
        with pytest.raises(RuntimeError, match=f"{kubo_nodes[0].peer_id}|exited"):
            start_nodes(1, tmp_path, on_ready=handed_on.append)
    assert handed_on == []
    assert Kubo(kubo_nodes[0].api).id() == kubo_nodes[0].peer_id  # the other one runs on


def test_a_worker_sent_a_second_sigterm_while_it_handles_the_first_still_stops(kubo_nodes):
    # local_swarm and stop_worker each send a SIGTERM: the second may come while the first is
    # being handled. Here it comes at the worst moment: inside `stop.set()`, its lock held.
    code = (
        "import os, signal, sys, threading, time\n"
        "from gridgraph.exec.ipfs.worker_main import run_worker\n"
        "class Twice(threading.Event):\n"
        "    def set(self):\n"
        "        with self._cond:\n"
        "            if not getattr(self, 'again', False):\n"
        "                self.again = True\n"
        "                os.kill(os.getpid(), signal.SIGTERM)\n"
        "                time.sleep(0.5)  # (the main thread handles it meanwhile)\n"
        "            self._flag = True\n"
        "            self._cond.notify_all()\n"
        "threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM)).start()\n"
        "sys.exit(run_worker(sys.argv[1], 'twice', stop=Twice(), isolate=False, heartbeat=0.1))\n"
    )
    worker = subprocess.Popen([sys.executable, "-c", code, kubo_nodes[0].api])
    try:
        assert worker.wait(timeout=120) == 0  # before: the second handler waited for ever
    finally:
        worker.kill()
