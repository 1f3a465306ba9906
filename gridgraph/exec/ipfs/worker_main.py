"""The worker process on a Kubo node: what `gridgraph worker` runs.

It announces itself on the discovery topic every `heartbeat` s (and at once when a client
asks), once it can serve (its executors' forkserver up), with its message limit, client
memory limit and load (discovery.ANNOUNCED); refuses to start under a name a live worker
already holds, serves requests with a `Worker` (exec/worker/worker.py) over a
`WorkerTransport`, frees the tensors of clients silent past their lease, and says goodbye on
the discovery topic when it stops (SIGTERM/SIGINT).

Its discovery directory serves the rival check and says whether another worker is still alive
(a recv from a dead one fails at once); it never says who another worker is: each run names
the identities of the workers it sends to and receives from (worker.py).
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable

from gridgraph.exec import wire
from gridgraph.exec.ipfs.discovery import (
    DEFAULT_LEASE,
    HEARTBEAT,
    Directory,
    check_name,
    load_trust,
    subscription_probe,
    trusted_peers,
)
from gridgraph.exec.ipfs.kubo import KuboError
from gridgraph.exec.ipfs.transport import (
    MAX_PAYLOAD,
    WorkerTransport,
    largest_payload,
    open_transport,
)
from gridgraph.exec.isolation import executor
from gridgraph.exec.protocol import DISCOVERY_TOPIC
from gridgraph.exec.safety.budget import MemoryBudget
from gridgraph.exec.safety.limits import Limits
from gridgraph.exec.worker.worker import Worker

log = logging.getLogger("gridgraph.ipfs")

READY_WAIT = 30.0  # seconds a worker waits for its executors to be ready before announcing


def run_worker(
    ipfs: str,
    name: str,
    *,
    lease: float = DEFAULT_LEASE,
    heartbeat: float = HEARTBEAT,
    recv_timeout: float = 120.0,
    limits: Limits | None = None,
    isolate: bool = True,
    stop: threading.Event | None = None,
    allow_peers: str | None = None,
) -> int:
    """Serve as worker `name` through the Kubo node at `ipfs` until SIGTERM/SIGINT (or `stop`).

    Announces itself every `heartbeat` s, frees the tensors of clients silent for `lease` s,
    grants each client the budgets of `limits` (default `Limits()`, see limits.py), runs each
    client session's programs in an executor process of its own unless `isolate` is False, and
    says goodbye on the discovery topic when it stops. Returns the exit status.

    Example:
        run_worker("/ip4/127.0.0.1/tcp/5001", "w1")   # what `gridgraph worker` runs
    """
    check_name(name)
    if not lease > 0:
        raise ValueError(f"lease must be positive, got {lease}")
    limits = limits or Limits()
    stop = stop or threading.Event()
    max_payload = min(MAX_PAYLOAD, limits.max_message_bytes)
    allow = trusted_peers(load_trust(allow_peers)) if allow_peers else None
    # One memory budget for the process: payloads being fetched and what the runtime keeps.
    budget = MemoryBudget.of(limits)
    transport = open_transport(
        WorkerTransport, ipfs, deliver_own=True, max_payload=max_payload, allow=allow,
        budget=budget,
    )  # fmt: skip
    on_main_thread = threading.current_thread() is threading.main_thread()
    restore = _stop_on_signals(stop) if on_main_thread else lambda: None
    try:
        return _serve_as_worker(
            transport, ipfs, name, lease, heartbeat, recv_timeout, limits, isolate, stop
        )
    finally:
        restore()


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _stop_on_signals(stop: threading.Event) -> Callable[[], None]:
    """Have SIGTERM and SIGINT set `stop`; return what undoes it.

    `stop` is set by a thread of our own, woken through the signal wakeup fd; the handlers
    themselves do nothing. A handler that set it could be run again inside its own
    `stop.set()`, by a second signal (a SIGTERM sent twice), and wait for ever on the lock
    that its first run holds."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    previous_fd = signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    handlers = {sig: signal.signal(sig, lambda *_: None) for sig in STOP_SIGNALS}

    def watch() -> None:  # until restore closes the pipe
        with os.fdopen(wake_r, "rb", buffering=0) as wake:
            while chunk := wake.read(64):
                if any(number in STOP_SIGNALS for number in chunk):
                    stop.set()

    threading.Thread(target=watch, name="gridgraph-signals", daemon=True).start()

    def restore() -> None:
        signal.set_wakeup_fd(previous_fd)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        os.close(wake_w)

    return restore


def _serve_as_worker(
    transport: WorkerTransport, ipfs: str, name: str, lease: float, heartbeat: float,
    recv_timeout: float, limits: Limits, isolate: bool, stop: threading.Event,
) -> int:  # fmt: skip
    instance = uuid.uuid4().hex[:12]
    asked = threading.Event()  # a client asked for announcements (or we are stopping)
    threading.Thread(target=lambda: (stop.wait(), asked.set()), daemon=True).start()
    # Who else is alive, and whether a rival holds our name. Not whom to send transfers to, nor
    # whom to take them from: each run names those identities (worker.py), and the transport
    # has no directory, so nothing goes to a worker topic without one.
    directory = Directory(
        on_discover=asked.set, trust=transport.allow, subscribed=subscription_probe(transport)
    )  # private: allowed only
    transport.subscribe(DISCOVERY_TOPIC, directory.on_message)
    # Executors fork from a server that imports torch first: start it now, not on a client's
    # first request (pings, as `connect` sends, are answered without it meanwhile).
    isolation = executor.Isolation() if isolate else None
    if isolation is not None:
        isolation.prewarm()
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
    unknown: dict[str, float] = {}  # worker names asked about but never heard of
    worker = Worker(
        name,
        transport,
        recv_timeout=recv_timeout,
        limits=limits,
        isolation=isolation,
        peer_alive=lambda n: _alive(directory, n, 3 * heartbeat, unknown),
        budget=transport.budget,
    )
    if isolation is not None:  # announced once it serves: its executors' forkserver is up
        warm = threading.Thread(target=executor.prewarm, daemon=True)
        warm.start()
        warm.join(READY_WAIT)
        if warm.is_alive():  # (a machine this busy: better slow than unheard)
            log.warning("%s: executors not ready after %g s; announcing anyway", name, READY_WAIT)
    log.info("worker %s up: peer %s via %s, lease %g s", name, transport.identity, ipfs, lease)
    # What is loaded by now (torch, its modules) stays for the process's life: out of the
    # collector's sight, it costs no time in collections, nor in the collection at exit.
    gc.freeze()
    failing = False
    load = _Load(worker)
    largest = min(largest_payload(transport.max_payload), limits.max_message_bytes)

    def announce(kind: str, seq: int) -> None:
        nonlocal failing
        msg = {"kind": kind, "name": name, "instance": instance, "lease": lease, "seq": seq,
               "max_message": largest, **load.now()}  # fmt: skip
        if limits.max_client_memory is not None:
            msg["max_memory"] = limits.max_client_memory
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
                log.info("%s: %d clients, %d tensors (%d bytes held); %d ops run since their "
                         "last stats reset", name, *report)  # fmt: skip
        asked.wait(heartbeat)
        asked.clear()
        stop.wait(0.05)  # at most 20 announcements a second, however often we are asked
    log.info("worker %s stopping", name)
    announce("leave", seq)
    worker.close()
    return 0


class _Load:
    """What a worker announces of its load (discovery.ANNOUNCED): its sessions, the bytes
    they hold, and the seconds spent serving per second since the last announcement."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.at, self.busy = time.monotonic(), worker.busy_seconds

    def now(self) -> dict[str, float]:
        now, busy = time.monotonic(), self.worker.busy_seconds
        load = (busy - self.busy) / max(now - self.at, 1e-3)
        self.at, self.busy = now, busy
        try:  # session threads may change them meanwhile: a clash leaves them out once
            sessions = list(self.worker.sessions.values())
            held = sum(s.memory() for s in sessions)
        except (RuntimeError, KeyError):
            return {"load": round(load, 3)}
        return {"sessions": len(sessions), "held": held, "load": round(load, 3)}


def _alive(directory: Directory, name: str, grace: float, unknown: dict[str, float]) -> bool:
    """Whether worker `name` still answers. One never heard of may still be starting: it
    counts as alive for `grace` s after it was first asked about (`unknown` says when), then
    as gone."""
    if directory.identity(name) is not None:
        return directory.alive(name)
    if len(unknown) > 1000:  # names from hostile programs: forget them
        unknown.clear()
    first = unknown.setdefault(name, time.monotonic())
    return time.monotonic() - first < grace


def _expire(worker: Worker, lease: float) -> tuple | None:
    """Free the tensors of clients silent past the lease; return what the worker holds."""
    try:  # session threads may change their state meanwhile: a clash only delays this
        worker.expire_clients(lease)
        sessions = list(worker.sessions.values())
        return (
            len(sessions),
            sum(len(s.work.store) for s in sessions),
            sum(s.memory() for s in sessions),
            sum(s.work.ops_run for s in sessions),
        )
    except (RuntimeError, KeyError) as e:
        log.debug("%s: lease check deferred: %s", worker.name, e)
        return None
