"""Grids over Kubo: worker discovery, the worker process, and `connect()` for clients.

Discovery: every worker publishes a heartbeat on `DISCOVERY_TOPIC` every `HEARTBEAT` seconds,
`{"kind": "announce", "name", "instance", "lease", "seq"}` (at once, too, when a client
publishes `{"kind": "discover"}` there), and `{"kind": "leave", ...}` when it stops cleanly.
A `Directory` follows that topic and keeps, per worker name, the peer id
that announced it (signed by libp2p, so trustworthy), the process instance and when it was
last heard. Policy:
- a worker is alive while heard within `DEAD_AFTER` seconds and not gone (`leave`); a client
  waiting on a dead worker raises `WorkerLost` (Client polls `alive` every 0.25 s), so a
  killed worker is noticed in DEAD_AFTER + ~1 s;
- a name belongs to the first peer that announces it; another peer claiming it while the
  owner is alive is ignored (and logged), so no peer can hijack a live worker's transfers;
- a client pins the instance it connected to: a worker restarted under the same name has lost
  its tensors, so to that client it is lost too.

Workers use their Directory to check that a transfer claiming to come from worker `w` was
published by `w`'s peer. PubSub loses a message now and then (see GridTransport): clients
resend requests after `retry_after` (0.5 s, backing off) and workers ask each other to resend
transfers; every resent message carries its original id, so nothing runs twice.

Clients ping (a `stats` request, which workers leave out of the traffic counts) every worker
at a third of the workers' lease, so an idle but open grid keeps its tensors; a client silent
past the lease has them freed.

Example:
    # shell: gridgraph ipfs up --nodes 3 --root /tmp/swarm; one `gridgraph worker` per node
    with connect("/ip4/127.0.0.1/tcp/5001", min_workers=3) as grid:
        x = torch.ones(3).send(grid.workers[0])
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from gridgraph.errors import GridError
from gridgraph.exec import wire
from gridgraph.exec.client import Client
from gridgraph.exec.grid import Grid
from gridgraph.exec.ipfs_nodes import start_nodes, stop_nodes
from gridgraph.exec.ipfs_transport import (
    BLOCK_SIZE,
    INLINE_MAX,
    IpfsTransport,
    MalformedEnvelope,
    pack_blocks,
    pack_inline,
    unpack,
)
from gridgraph.exec.kubo import KuboError
from gridgraph.exec.transport import Handler, Transport
from gridgraph.exec.worker import DISCOVERY_TOPIC, Worker, worker_topic
from gridgraph.schedule.cost import CostModel

log = logging.getLogger("gridgraph.ipfs")

DEFAULT_API = "/ip4/127.0.0.1/tcp/5001"
HEARTBEAT = 1.0  # seconds between a worker's announcements
DEAD_AFTER = 5.0  # a worker unheard for this long is lost (WorkerLost within 10 s)
DEFAULT_LEASE = 300.0  # a silent client's tensors are freed after this long
MAX_PAYLOAD = 1 << 30  # a worker fetches no message larger than this (bytes)
PUBLISH_TRIES = 8  # publishes refused by Kubo's own seqno check are retried this often
STORED_KEPT = 16  # large payloads whose blocks a transport remembers, for resending
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def check_name(name: str) -> str:
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ValueError(f"bad worker name {name!r}: use 1-64 letters, digits, '_', '.', '-'")
    return name


# --- discovery ------------------------------------------------------------------------------


@dataclass
class Seen:
    """What the directory knows about one worker name."""

    identity: str  # peer id that announced it
    instance: str  # the announcing process (changes on restart)
    last_seen: float
    lease: float
    gone: bool = False


class Directory:
    """Workers heard on the discovery topic: name -> peer id, instance, last seen.

    Example:
        directory = Directory()
        transport.subscribe(DISCOVERY_TOPIC, directory.on_message)
        names = directory.wait(min_workers=3, timeout=60)
        directory.alive("w1"), directory.identity("w1")
    """

    def __init__(
        self, dead_after: float = DEAD_AFTER, on_discover: Callable[[], None] = lambda: None
    ) -> None:
        self.dead_after = dead_after
        self.on_discover = on_discover  # a worker announces itself now
        self._seen: dict[str, Seen] = {}
        self._pinned: dict[str, str] = {}  # name -> instance this client connected to
        self._warned: set[tuple[str, str]] = set()
        self._cv = threading.Condition()

    def on_message(self, sender: str, payload: bytes) -> None:
        """The discovery topic's handler: record announcements and departures; pass on a
        client's request to announce now."""
        try:
            msg = wire.decode(payload)
            if msg["kind"] == "discover":  # a client looking for workers: answer at once
                self.on_discover()
                return
            name, instance = check_name(msg.get("name")), msg.get("instance")
            if not isinstance(instance, str):
                raise ValueError("no instance")
        except ValueError as e:  # WireError is a ValueError
            log.warning("ignored a discovery message from %s: %s", sender, e)
            return
        now = time.monotonic()
        with self._cv:
            known = self._seen.get(name)
            if known is not None and known.identity != sender and self._fresh(known, now):
                if (name, sender) not in self._warned:
                    self._warned.add((name, sender))
                    log.warning(
                        "peer %s claims worker name %r, which belongs to live peer %s; ignored",
                        sender,
                        name,
                        known.identity,
                    )
                return
            if msg["kind"] == "announce":
                lease = msg.get("lease")
                lease = float(lease) if isinstance(lease, int | float) else DEFAULT_LEASE
                self._seen[name] = Seen(sender, instance, now, lease)
            elif msg["kind"] == "leave" and known is not None and known.instance == instance:
                known.gone = True
            self._cv.notify_all()

    def _fresh(self, seen: Seen, now: float) -> bool:
        return not seen.gone and now - seen.last_seen <= self.dead_after

    def live(self) -> list[str]:
        """Names of the workers heard lately, sorted."""
        now = time.monotonic()
        with self._cv:
            return sorted(n for n, s in self._seen.items() if self._fresh(s, now))

    def alive(self, name: str) -> bool:
        """Heard lately, and (once pinned) still the same process."""
        with self._cv:
            seen = self._seen.get(name)
            if seen is None or not self._fresh(seen, time.monotonic()):
                return False
            return self._pinned.get(name, seen.instance) == seen.instance

    def identity(self, name: str, wait: float = 0.0) -> str | None:
        """The peer id of worker `name`, waiting up to `wait` s to hear of it; None if unknown."""
        deadline = time.monotonic() + wait
        with self._cv:
            while name not in self._seen and time.monotonic() < deadline:
                self._cv.wait(deadline - time.monotonic())
            seen = self._seen.get(name)
            return seen.identity if seen is not None else None

    def heard_since(self, name: str, since: float) -> Seen | None:
        with self._cv:
            seen = self._seen.get(name)
            return seen if seen is not None and seen.last_seen >= since else None

    def lease(self, names: list[str]) -> float:
        """The shortest lease these workers announce."""
        with self._cv:
            return min(
                (self._seen[n].lease for n in names if n in self._seen), default=DEFAULT_LEASE
            )

    def pin(self, names: list[str]) -> None:
        """Remember which process answers to each name; a later one counts as a lost worker."""
        with self._cv:
            for n in names:
                self._pinned[n] = self._seen[n].instance

    def wait(
        self,
        min_workers: int = 1,
        timeout: float = 60.0,
        names: list[str] | None = None,
        settle: float = 0.0,
        where: str = "the grid",
    ) -> list[str]:
        """Wait until `names` (or at least `min_workers` workers) are alive; return the names.

        Without `names`, keeps listening until `settle` s have passed, so every live worker
        has announced itself at least once. Raises GridError at `timeout`.
        """
        start = time.monotonic()
        with self._cv:
            while True:
                live = self.live()
                now = time.monotonic()
                if names is not None:
                    if all(n in live for n in names):
                        return list(names)
                elif len(live) >= min_workers and (now - start >= settle or now - start > timeout):
                    return live
                if now - start > timeout:
                    wanted = f"workers {', '.join(names)}" if names else f"{min_workers} workers"
                    raise GridError(
                        f"waited {timeout:g} s for {wanted} on {where}; found {len(live)} "
                        f"({', '.join(live) or 'none'}). Start workers with `gridgraph worker "
                        f"--ipfs ADDR --name NAME`, on nodes connected to this one (check "
                        f"`ipfs swarm peers`)"
                    )
                self._cv.wait(0.1)


# --- the client side ------------------------------------------------------------------------


def connect(
    ipfs: str = DEFAULT_API,
    min_workers: int = 1,
    timeout: float = 60.0,
    *,
    workers: list[str] | None = None,
    lease: float | None = None,
    retry_after: float = 0.5,
    dead_after: float = DEAD_AFTER,
    memory_cap: int | dict[str, int] | None = None,
) -> Grid:
    """A Grid of the live workers reachable through the Kubo node whose API is `ipfs`.

    Waits until at least `min_workers` workers announce themselves (or exactly `workers`,
    when named), then keeps every live one it heard; raises GridError after `timeout` s.
    `lease`: the silence after which workers free this client's tensors, as the client
    assumes it to ping them in time (default: the shortest lease they announce).
    `retry_after`: resend a request unanswered this long (then after 2x, 4x, ... up to 8x);
    PubSub loses about one message in a few hundred, and a worker answers a repeated request
    from its reply cache. `dead_after`: a worker unheard this long is lost (`WorkerLost`).
    `memory_cap`: bytes per worker (or per worker name) that placement keeps new tensors under.

    Example:
        with gg.connect(ipfs="/ip4/127.0.0.1/tcp/5001", min_workers=3) as grid:
            w0, w1, w2 = grid.workers
            print((torch.ones(3).send(w0) + 1).get())
    """
    return grid_over(
        _open(GridTransport, ipfs, deliver_own=True),  # a worker may share this node
        min_workers=min_workers,
        timeout=timeout,
        workers=workers,
        lease=lease,
        retry_after=retry_after,
        dead_after=dead_after,
        memory_cap=memory_cap,
        where=ipfs,
    )


def grid_over(
    transport: Transport,
    *,
    min_workers: int = 1,
    timeout: float = 60.0,
    workers: list[str] | None = None,
    lease: float | None = None,
    retry_after: float = 0.5,
    dead_after: float = DEAD_AFTER,
    memory_cap: int | dict[str, int] | None = None,
    where: str = "the grid",
) -> Grid:
    """`connect` on a transport you built (tests wrap it to drop or repeat messages).

    The grid owns `transport` from here on: closing the grid, or a failure here, closes it.
    """
    try:
        if type(min_workers) is not int or min_workers < 1:
            raise ValueError(f"min_workers must be a positive int, got {min_workers!r}")
        directory = Directory(dead_after)
        transport.subscribe(DISCOVERY_TOPIC, directory.on_message)
        ask_workers(transport)
        names = directory.wait(min_workers, timeout, workers, settle=HEARTBEAT, where=where)
        directory.pin(names)
        client = Client(
            transport,
            names,
            retry_after=retry_after,
            alive=directory.alive,
            cost=CostModel.pubsub(),
            memory_cap=memory_cap,
        )
        # The first replies may go out before the workers' nodes learn of our reply topic: one
        # quick round trip each, resent often, makes sure the grid answers before it is used.
        client.retry_after, default_timeout, client.timeout = 0.25, client.timeout, timeout
        for name in names:
            client.request(name, {"kind": "ping"}, counted=False)
        client.retry_after, client.timeout = retry_after, default_timeout
    except BaseException:
        transport.close()
        raise
    keepalive = _KeepAlive(client, directory, lease or directory.lease(names))
    keepalive.start()
    log.info("connected to %d workers on %s: %s", len(names), where, ", ".join(names))
    return Grid(client, on_close=keepalive.stop.set)


def ask_workers(transport: Transport) -> None:
    """Ask every worker to announce itself now rather than at its next heartbeat."""
    try:
        transport.publish(DISCOVERY_TOPIC, wire.encode({"kind": "discover"}), counted=False)
    except KuboError as e:  # the heartbeats will do
        log.debug("discover: %s", e)


class _KeepAlive(threading.Thread):
    """Pings each worker at a third of the lease, so an idle grid keeps its tensors."""

    def __init__(self, client: Client, directory: Directory, lease: float) -> None:
        super().__init__(name=f"gridgraph-keepalive-{client.session}", daemon=True)
        self.client, self.directory = client, directory
        self.interval = lease / 3
        self.stop = threading.Event()

    def run(self) -> None:
        if not math.isfinite(self.interval):
            return
        while not self.stop.wait(self.interval):
            for w in self.client.workers:
                if self.client.closed or self.stop.is_set():
                    return
                if not self.directory.alive(w):
                    continue
                # A stats request: read-only, and kept out of the traffic counts on both ends.
                msg = {
                    "kind": "stats",
                    "id": uuid.uuid4().hex,
                    "reply_to": self.client.topic,
                    "session": self.client.session,
                    "free": [],
                }
                try:
                    self.client.transport.publish(worker_topic(w), wire.encode(msg), False)
                except Exception as e:  # closed under us, or Kubo is down: try next time
                    log.debug("keepalive to %s failed: %s", w, e)


# --- transports ----------------------------------------------------------------------------


class GridTransport(IpfsTransport):
    """IpfsTransport tuned for gridgraph's retries. Upstream candidates, both:

    - Publishes again when Kubo refuses a message with "validation ignored". Kubo validates a
      node's own publications concurrently and ignores one whose seqno is below one it already
      accepted, so two threads or processes publishing through one node at once (a worker's
      heartbeat and its replies, a client sharing a worker's node) make one fail. That message
      never went out: sending it again is safe. (Receiving nodes run the same check, also
      concurrently, and drop a message now and then: the layers above resend.)
    - Stores a large payload's blocks once: a retried request or transfer (the same bytes)
      publishes only a new envelope naming the same blocks.
    """

    def __init__(self, api: str, **kwargs) -> None:
        super().__init__(api, **kwargs)
        self._stored: OrderedDict[bytes, list[tuple[str, int]]] = OrderedDict()  # by digest
        self._stored_lock = threading.Lock()

    def publish(self, topic: str, payload: bytes, counted: bool = True) -> None:
        if self._closed.is_set():
            raise RuntimeError(f"transport {self.identity} is closed")
        if len(payload) <= INLINE_MAX:
            message, blocked = pack_inline(bytes(payload)), 0
        else:
            message, blocked = pack_blocks(self._blocks(payload), len(payload)), len(payload)
        for attempt in range(PUBLISH_TRIES):
            try:
                self.kubo.pubsub_pub(topic, message)
                break
            except KuboError as e:
                if "validation ignored" not in str(e) or attempt == PUBLISH_TRIES - 1:
                    raise
                time.sleep(0.001 * 2**attempt)
        if counted:
            self.sent.add(len(message) + blocked)

    def _blocks(self, payload: bytes) -> list[tuple[str, int]]:
        digest = hashlib.blake2b(payload, digest_size=16).digest()
        with self._stored_lock:
            if digest in self._stored:
                self._stored.move_to_end(digest)
                return self._stored[digest]
        view = memoryview(payload)
        pieces = [view[i : i + BLOCK_SIZE] for i in range(0, len(view), BLOCK_SIZE)]
        blocks = [(self.kubo.block_put(bytes(piece)), len(piece)) for piece in pieces]
        with self._stored_lock:
            self._stored[digest] = blocks
            while len(self._stored) > STORED_KEPT:
                self._stored.popitem(last=False)
        return blocks


def _open(cls: type[IpfsTransport], ipfs: str, **kwargs) -> IpfsTransport:
    try:
        return cls(ipfs, **kwargs)
    except KuboError as e:
        raise KuboError(f"cannot reach the Kubo node at {ipfs} ({e}); is `ipfs daemon` running "
                        "there? (`gridgraph ipfs up` starts a local swarm)") from e  # fmt: skip


class WorkerTransport(GridTransport):
    """GridTransport for a worker: refuses oversized messages before fetching their blocks,
    and logs each message it receives (DEBUG)."""

    def __init__(self, api: str, *, max_payload: int = MAX_PAYLOAD, **kwargs) -> None:
        super().__init__(api, **kwargs)
        self.max_payload = max_payload

    def _payload(self, message: bytes) -> bytes:
        envelope = unpack(message)
        size = envelope["t"] if "b" in envelope else len(envelope["d"])
        if size > self.max_payload:
            raise MalformedEnvelope(f"{size} bytes is over this worker's {self.max_payload}")
        return super()._payload(message)

    def subscribe(self, topic: str, handler: Handler) -> None:
        def logged(sender: str, payload: bytes) -> None:
            log.debug("%d bytes on %s from %s", len(payload), topic, sender)
            handler(sender, payload)

        super().subscribe(topic, logged if topic != DISCOVERY_TOPIC else handler)


# --- the worker process ---------------------------------------------------------------------


def run_worker(
    ipfs: str,
    name: str,
    *,
    lease: float = DEFAULT_LEASE,
    heartbeat: float = HEARTBEAT,
    recv_timeout: float = 120.0,
    max_payload: int = MAX_PAYLOAD,
    stop: threading.Event | None = None,
) -> int:
    """Serve as worker `name` through the Kubo node at `ipfs` until SIGTERM/SIGINT (or `stop`).

    Announces itself every `heartbeat` s, frees the tensors of clients silent for `lease` s,
    and says goodbye on the discovery topic when it stops. Returns the exit status.

    Example:
        run_worker("/ip4/127.0.0.1/tcp/5001", "w1")   # what `gridgraph worker` runs
    """
    check_name(name)
    if not lease > 0:
        raise ValueError(f"lease must be positive, got {lease}")
    stop = stop or threading.Event()
    transport = _open(WorkerTransport, ipfs, deliver_own=True, max_payload=max_payload)
    handlers = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            handlers[sig] = signal.signal(sig, lambda *_: stop.set())
    try:
        return _serve_as_worker(transport, ipfs, name, lease, heartbeat, recv_timeout, stop)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def _serve_as_worker(
    transport: WorkerTransport, ipfs: str, name: str, lease: float, heartbeat: float,
    recv_timeout: float, stop: threading.Event,
) -> int:  # fmt: skip
    instance = uuid.uuid4().hex[:12]
    asked = threading.Event()  # a client asked for announcements (or we are stopping)
    threading.Thread(target=lambda: (stop.wait(), asked.set()), daemon=True).start()
    directory = Directory(on_discover=asked.set)
    transport.subscribe(DISCOVERY_TOPIC, directory.on_message)
    # Refuse a name another running worker announces: two would answer the same requests.
    listening = time.monotonic()
    if stop.wait(1.5 * heartbeat):
        transport.close()
        return 0
    rival = directory.heard_since(name, listening)
    if rival is not None:
        transport.close()
        log.error("a worker named %r is already running (peer %s); pick another --name",
                  name, rival.identity)  # fmt: skip
        return 1
    worker = Worker(
        name,
        transport,
        recv_timeout=recv_timeout,
        peer_identity=lambda n: directory.identity(n, wait=2 * heartbeat),
        # a worker never heard of may still be starting: only one gone silent is dead
        peer_alive=lambda n: directory.identity(n) is None or directory.alive(n),
    )
    log.info("worker %s up: peer %s via %s, lease %g s", name, transport.identity, ipfs, lease)
    failing = False

    def announce(kind: str, seq: int) -> None:
        nonlocal failing
        msg = {"kind": kind, "name": name, "instance": instance, "lease": lease, "seq": seq}
        try:
            transport.publish(DISCOVERY_TOPIC, wire.encode(msg), counted=False)
        except KuboError as e:
            if not failing:  # once, not every second while the node is down
                log.warning("%s: cannot announce through %s: %s", name, ipfs, e)
            failing = True
            return
        if failing:
            log.info("%s: announcing again", name)
        failing = False

    check_every = min(max(lease / 4, heartbeat), 30.0)
    next_check = time.monotonic() + check_every
    last_report: tuple = ()
    seq = 0
    while not stop.is_set():
        announce("announce", seq)
        seq += 1
        if time.monotonic() >= next_check:
            next_check = time.monotonic() + check_every
            report = _expire(worker, lease)
            if report is not None and report != last_report:
                last_report = report
                log.info("%s: %d clients, %d tensors (%d bytes); %d ops run since the last "
                         "stats reset", name, *report)  # fmt: skip
        asked.wait(heartbeat)
        asked.clear()
        stop.wait(0.05)  # at most 20 announcements a second, however often we are asked
    log.info("worker %s stopping", name)
    announce("leave", seq)
    worker.close()
    return 0


def _expire(worker: Worker, lease: float) -> tuple | None:
    """Free the tensors of clients silent past the lease; return what the worker holds."""
    try:  # the execution thread may change the store meanwhile: a clash only delays this
        worker.expire_clients(lease)
        store = worker.store
        return len(store.clients()), len(store), store.stored_bytes(), worker.ops_run
    except (RuntimeError, KeyError) as e:
        log.debug("%s: lease check deferred: %s", worker.name, e)
        return None


# --- local processes: what tests, the demo and the benchmark start --------------------------


def spawn_worker(
    api: str, name: str, log_path: Path, *, lease: float | None = None, log_level: str = "INFO"
) -> subprocess.Popen:
    """Start `python -m gridgraph worker` on the node at `api`, logging to `log_path`."""
    args = [sys.executable, "-m", "gridgraph", "worker", "--ipfs", api,
            "--name", check_name(name), "--log-level", log_level]  # fmt: skip
    if lease is not None:
        args += ["--lease", str(lease)]
    with open(log_path, "ab") as out:
        return subprocess.Popen(
            args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )


def stop_worker(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGTERM one worker process we started (by its pid), SIGKILL it after `grace` s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def discover(
    ipfs: str,
    min_workers: int = 1,
    timeout: float = 60.0,
    names: list[str] | None = None,
    procs: list[subprocess.Popen] = (),
) -> list[str]:
    """The live workers heard through `ipfs` (as `connect` would find them), without a client.

    Fails early, naming it, if one of `procs` (workers we started) exits meanwhile.
    """
    transport = IpfsTransport(ipfs, deliver_own=True)
    try:
        directory = Directory()
        transport.subscribe(DISCOVERY_TOPIC, directory.on_message)
        ask_workers(transport)
        deadline = time.monotonic() + timeout
        while True:
            for proc in procs:
                if proc.poll() is not None:
                    raise GridError(
                        f"worker process {' '.join(proc.args[-6:])} exited with {proc.returncode}"
                    )
            try:
                left = min(1.0, deadline - time.monotonic())
                return directory.wait(min_workers, left, names, settle=HEARTBEAT, where=ipfs)
            except GridError:
                if time.monotonic() >= deadline:
                    raise
    finally:
        transport.close()


@contextlib.contextmanager
def local_swarm(n: int, root: Path, *, log_level: str = "INFO") -> Iterator[list[str]]:
    """`n` loopback Kubo nodes under `root`, worker w<i> on node i; yields the nodes' APIs.

    Everything started here is stopped on exit (workers by pid, then the daemons).

    Example:
        with local_swarm(3, Path("/tmp/swarm")) as apis, connect(apis[0], 3) as grid: ...
    """
    root = Path(root)
    nodes = start_nodes(n, root)
    procs: list[subprocess.Popen] = []
    try:
        for node in nodes:
            log_path = root / f"worker{node.index}.log"
            procs.append(spawn_worker(node.api, f"w{node.index}", log_path, log_level=log_level))
        discover(nodes[0].api, names=[f"w{i}" for i in range(n)], timeout=60, procs=procs)
        yield [node.api for node in nodes]
    finally:
        for proc in procs:
            stop_worker(proc)
        stop_nodes(root)
