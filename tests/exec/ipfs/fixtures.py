"""Real Kubo daemons and gridgraph workers for the `ipfs`-marked tests.

Fixtures (tests/conftest.py imports them, so every test module can use them; `outsider_node`
is imported by tests/exec/conftest.py, for the tests under tests/exec/):
- `kubo_nodes` (session): three connected loopback Kubo nodes in a temporary directory,
  stopped by their recorded pids at the end;
- `ipfs_workers` (session): one `python -m gridgraph worker` process per node, named w0, w1,
  w2 (w<i> on node i), logging to `<tmp>/workers/w<i>.log`; stopped by pid at the end;
- `outsider_node` (module): a fourth node connected to the three, with no worker (for spies
  and attackers);
- `Tap` (wraps a transport to drop or repeat messages) and `Raw` (a peer sending hand-made
  requests) for tests of lost and hostile messages;
- `ipfs_grid` (function): `gg.connect(ipfs=<node 0's API>, min_workers=3)`, closed after the
  test. The client shares node 0 with w0; w1 and w2 are one pubsub hop away.
Tests are skipped, saying why, only when the `ipfs` binary is missing.
"""

from __future__ import annotations

import queue
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import gridgraph as gg
from gridgraph.exec import wire
from gridgraph.exec.ipfs.discovery import Directory, ask_workers, discover
from gridgraph.exec.ipfs.kubo import Kubo
from gridgraph.exec.ipfs.swarm import (
    NodeInfo,
    find_ipfs_binary,
    spawn_worker,
    start_nodes,
    stop_nodes,
    stop_worker,
)
from gridgraph.exec.ipfs.transport import GridTransport
from gridgraph.exec.protocol import DISCOVERY_TOPIC, client_topic, worker_topic
from gridgraph.exec.transport import Handler, Transport


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
    nodes: list[tuple[NodeInfo, str]],
    log_dir: Path,
    lease: float | None = None,
    options: list[str] = (),
) -> list[WorkerProcess]:
    """Start one worker per (node, name) and wait until each announces itself (`options`:
    more `gridgraph worker` flags)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    workers = [
        WorkerProcess(
            name,
            node,
            spawn_worker(node.api, name, log_dir / f"{name}.log", lease=lease, options=options),
            log_dir / f"{name}.log",
        )
        for node, name in nodes
    ]
    try:
        discover(
            nodes[0][0].api,
            names=[w.name for w in workers],
            timeout=120,  # (workers announce once their executors' forkserver is up)
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


@pytest.fixture(scope="module")
def outsider_node(
    kubo_nodes: list[NodeInfo], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[NodeInfo]:
    """A fourth Kubo node, connected to the other three, that runs no worker: the peer an
    attacker or a spy would use (its peer ID is in no trust list). Per module, so that the
    other modules see the swarm of three."""
    root = tmp_path_factory.mktemp("outsider")
    [node] = start_nodes(1, root)
    try:
        kubo = Kubo(node.api)
        for other in kubo_nodes:
            kubo.swarm_connect(other.swarm)
        yield node
    finally:
        stop_nodes(root)


class Tap(Transport):
    """Wraps an endpoint: `outgoing(topic, payload)` says how many times to really publish,
    `incoming(topic, payload)` whether to deliver. Counts what it dropped and repeated."""

    def __init__(
        self,
        inner: Transport,
        outgoing: Callable[[str, bytes], int] = lambda t, p: 1,
        incoming: Callable[[str, bytes], bool] = lambda t, p: True,
    ) -> None:
        super().__init__()
        self.inner, self.outgoing, self.incoming = inner, outgoing, incoming
        self.identity, self.sent = inner.identity, inner.sent
        self.dropped = self.repeated = 0

    def publish(
        self, topic: str, payload: bytes, counted: bool = True, to: str | None = None
    ) -> None:
        times = self.outgoing(topic, payload)
        self.dropped += times == 0
        self.repeated += max(times - 1, 0)
        for _ in range(times):
            self.inner.publish(topic, payload, counted, to)

    def subscribe(self, topic: str, handler: Handler) -> None:
        def filtered(sender: str, payload: bytes) -> None:
            if self.incoming(topic, payload):
                handler(sender, payload)
            else:
                self.dropped += 1

        self.inner.subscribe(topic, filtered)

    def close(self) -> None:
        self.inner.close()

    def recipient(self, topic: str) -> str | None:
        return self.inner.recipient(topic)

    @property
    def directory(self) -> Directory | None:
        return self.inner.directory

    @directory.setter
    def directory(self, directory: Directory) -> None:
        self.inner.directory = directory


def sealed_endpoint(api: str, **kwargs) -> GridTransport:
    """A grid endpoint of its own on the node at `api` that knows the workers' keys (from
    their heartbeats), so it can seal messages for them as any peer of the grid can."""
    transport = GridTransport(api, deliver_own=True, resolve_wait=10.0, **kwargs)
    transport.directory = Directory()
    transport.subscribe(DISCOVERY_TOPIC, transport.directory.on_message)
    ask_workers(transport)
    return transport


class Raw:
    """A bare peer that sends hand-made requests to workers and collects the replies: a
    client of its own (sealed for the worker, as any peer of the grid can), whose messages
    say what the test wants, any session included."""

    def __init__(self, api: str) -> None:
        self.transport = sealed_endpoint(api)
        self.session = uuid.uuid4().hex[:12]
        self.replies: queue.Queue[dict] = queue.Queue()
        self._topics: set[str] = set()
        self.topic = self.reply_topic(self.session)

    def reply_topic(self, session: str) -> str:
        """Our reply topic for `session` (the only one a worker answers us on)."""
        topic = client_topic(self.transport.identity, session)
        if topic not in self._topics:
            self._topics.add(topic)
            self.transport.subscribe(topic, lambda s, p: self.replies.put(wire.decode(p)))
        return topic

    def envelope(self, msg: dict) -> dict:
        """`msg` with a fresh id, and a session unless it names one (whose reply topic it
        subscribes)."""
        session = msg.get("session", self.session)
        self.reply_topic(session)
        return {"id": uuid.uuid4().hex, "session": session, **msg}

    def send(self, worker: str, msg: dict) -> str:
        msg = self.envelope(msg)
        self.publish(worker, wire.encode(msg))
        return msg["id"]

    def publish(self, worker: str, payload: bytes) -> None:
        self.transport.publish(worker_topic(worker), payload)

    def request(self, worker: str, msg: dict, timeout: float = 15.0) -> dict:
        """Send, resending the same request id until its reply comes."""
        msg = self.envelope({"free": [], **msg})
        rid, payload = msg["id"], wire.encode(msg)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.publish(worker, payload)
            try:
                while True:
                    reply = self.replies.get(timeout=0.5)
                    if reply.get("re") == rid:
                        return reply
            except queue.Empty:
                continue
        raise TimeoutError(f"no reply from {worker} to {msg.get('kind')}")

    def close(self) -> None:
        self.transport.close()
