"""Real Kubo daemons and gridgraph workers for the `ipfs`-marked tests.

Fixtures (tests/conftest.py imports them, so every test module can use them):
- `kubo_nodes` (session): three connected loopback Kubo nodes in a temporary directory,
  stopped by their recorded pids at the end;
- `ipfs_workers` (session): one `python -m gridgraph worker` process per node, named w0, w1,
  w2 (w<i> on node i), logging to `<tmp>/workers/w<i>.log`; stopped by pid at the end;
- `ipfs_grid` (function): `gg.connect(ipfs=<node 0's API>, min_workers=3)`, closed after the
  test. The client shares node 0 with w0; w1 and w2 are one pubsub hop away.
Tests are skipped, saying why, only when the `ipfs` binary is missing.
"""

from __future__ import annotations

import queue
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import gridgraph as gg
from gridgraph.exec.ipfs.discovery import discover
from gridgraph.exec.ipfs.swarm import (
    NodeInfo,
    find_ipfs_binary,
    spawn_worker,
    start_nodes,
    stop_nodes,
    stop_worker,
)


@pytest.fixture(scope="session")
def kubo_nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[NodeInfo]]:
    try:
        find_ipfs_binary()
    except FileNotFoundError as error:
        pytest.skip(str(error))
    root = tmp_path_factory.mktemp("kubo")
    nodes = start_nodes(3, root)
    try:
        yield nodes
    finally:
        stop_nodes(root)


class Inbox:
    """A handler that queues `(sender, payload)` pairs for the test to take."""

    def __init__(self) -> None:
        self.items: queue.Queue[tuple[str, bytes]] = queue.Queue()

    def __call__(self, sender: str, payload: bytes) -> None:
        self.items.put((sender, payload))

    def get(self, timeout: float = 10.0) -> tuple[str, bytes]:
        return self.items.get(timeout=timeout)

    def empty_after(self, seconds: float) -> bool:
        try:
            self.items.get(timeout=seconds)
        except queue.Empty:
            return True
        return False


@dataclass
class WorkerProcess:
    """A worker process a test started: `python -m gridgraph worker --name <name>`."""

    name: str
    node: NodeInfo
    proc: subprocess.Popen
    log: Path

    def log_tail(self, n: int = 2000) -> str:
        return self.log.read_text(errors="replace")[-n:]


def start_workers(
    nodes: list[tuple[NodeInfo, str]], log_dir: Path, lease: float | None = None
) -> list[WorkerProcess]:
    """Start one worker per (node, name) and wait until each announces itself."""
    log_dir.mkdir(parents=True, exist_ok=True)
    workers = [
        WorkerProcess(
            name,
            node,
            spawn_worker(node.api, name, log_dir / f"{name}.log", lease=lease),
            log_dir / f"{name}.log",
        )
        for node, name in nodes
    ]
    try:
        discover(
            nodes[0][0].api,
            names=[w.name for w in workers],
            timeout=60,
            procs=[w.proc for w in workers],
        )
    except BaseException as error:
        logs = "\n".join(f"--- {w.name}:\n{w.log_tail()}" for w in workers)
        stop_all(workers)
        raise RuntimeError(f"workers did not come up: {error}\n{logs}") from error
    return workers


def stop_all(workers: list[WorkerProcess]) -> None:
    for w in workers:
        stop_worker(w.proc)


@pytest.fixture(scope="session")
def ipfs_workers(
    kubo_nodes: list[NodeInfo], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[WorkerProcess]]:
    log_dir = tmp_path_factory.mktemp("workers")
    workers = start_workers([(node, f"w{node.index}") for node in kubo_nodes], log_dir)
    try:
        yield workers
    finally:
        stop_all(workers)


@pytest.fixture
def ipfs_grid(kubo_nodes: list[NodeInfo], ipfs_workers: list[WorkerProcess]) -> Iterator[gg.Grid]:
    names = [w.name for w in ipfs_workers]
    with gg.connect(ipfs=kubo_nodes[0].api, min_workers=3, workers=names, timeout=30) as grid:
        yield grid
