"""Real Kubo daemons for the `ipfs`-marked tests: import `kubo_nodes` into a test module.

The fixture starts three connected loopback nodes in a temporary directory once per session
and stops them (by their recorded pids) at the end. Tests are skipped, saying why, only when
the `ipfs` binary is missing.
"""

from __future__ import annotations

import queue
from collections.abc import Iterator

import pytest

from gridgraph.exec.ipfs_nodes import NodeInfo, find_ipfs_binary, start_nodes, stop_nodes


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
