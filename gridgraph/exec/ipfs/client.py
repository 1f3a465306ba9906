"""The client side of a grid over Kubo: `connect()`, and the keep-alive that holds its lease.

State: the grid's transport, its discovery `Directory` (`trust`, pinned workers) and a
`_KeepAlive` thread with a ping interval per worker. Policy:
- workers are found on the discovery topic (discovery.py), and the endpoint and process
  instance behind each name pinned: its messages, and the identities its runs name for it,
  stay those of the worker the client connected to;
- one that announces itself but does not answer a ping within PING_TIMEOUT s is left out of
  a grid asked for no names in particular (anyone can announce a name); a named one must;
- a worker that announces itself after `connect` (with `trust`, only one it names) joins the
  grid once it answers a ping, unless `workers=` named the grid's workers; one announced
  under a name the client pinned by another process of the same node (a restart) joins as
  a new worker, none of the old one's tensors assumed there (exec/client/lost.py); another
  peer that takes a pinned name stays out (as an impostor would);
- each worker is pinged (a `stats` request, which workers leave out of the traffic counts) at
  a third of the lease it announces, at most every MIN_PING_INTERVAL s: an idle grid keeps
  its tensors, and each worker's lease sets its own pings only;
- PubSub loses a message now and then: requests are resent after `retry_after` (0.5 s,
  backing off), or once sooner, after a wait learned from earlier answers to the same plan
  or kind of request (exec/resend.py); a resent message keeps its id, so nothing runs twice.

Example:
    # shell: gridgraph ipfs up --nodes 3 --root /tmp/swarm; one `gridgraph worker` per node
    with connect("/ip4/127.0.0.1/tcp/5001", min_workers=3) as grid:
        x = torch.ones(3).send(grid.workers[0])
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from pathlib import Path

from gridgraph.errors import GridError
from gridgraph.exec import wire
from gridgraph.exec.client import lost
from gridgraph.exec.client.client import Client
from gridgraph.exec.grid import Grid
from gridgraph.exec.ipfs.discovery import (
    DEAD_AFTER,
    HEARTBEAT,
    Directory,
    Trust,
    ask_workers,
    load_trust,
    subscription_probe,
    trusted_peers,
)
from gridgraph.exec.ipfs.progress import wanted
from gridgraph.exec.ipfs.transport import GridTransport, open_transport
from gridgraph.exec.protocol import DISCOVERY_TOPIC, worker_topic
from gridgraph.exec.transport import Transport
from gridgraph.schedule.cost import CostModel

log = logging.getLogger("gridgraph.ipfs")

DEFAULT_API = "/ip4/127.0.0.1/tcp/5001"
MIN_PING_INTERVAL = 0.5  # seconds: a worker's lease sets how often it is pinged, down to this
PING_TIMEOUT = 15.0  # seconds a worker found by discovery has to answer its first ping


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
    trust: str | Path | dict[str, str] | list[str] | None = None,
    progress: bool | None = None,
) -> Grid:
    """A Grid of the live workers reachable through the Kubo node whose API is `ipfs`.

    Waits until at least `min_workers` workers announce themselves (or exactly `workers`,
    when named), then keeps every live one it heard that answers a ping (within
    PING_TIMEOUT s; named ones must answer); raises GridError after `timeout` s.
    `lease`: the silence after which workers free this client's tensors, as the client
    assumes it to ping them in time (default: the lease each worker announces).
    `retry_after`: resend a request unanswered this long (then after 2x, 4x, ... up to 8x);
    first after what earlier answers to the same plan or kind of request took, if sooner
    (exec/resend.py);
    PubSub loses about one message in a few hundred, and a worker answers a repeated request
    from its reply cache. `dead_after`: a worker unheard this long is lost (`WorkerLost`).
    `memory_cap`: bytes per worker (or per worker name) that placement keeps new tensors under.
    `trust`: the workers this client uses, {name: peer ID}, a list of peer IDs, or a file of
    either (discovery.load_trust; `gridgraph id --ipfs ADDR` prints a node's peer ID); what
    other peers publish is dropped unopened. Default: any worker on the grid (an open grid),
    where a name two live peers claim raises GridError naming both.
    Every message and block is end-to-end encrypted either way (gridgraph.exec.ipfs.secure).
    `progress`: a progress bar on stderr for payloads over 64 MiB (default: when stderr is a
    terminal).

    Example:
        with gg.connect(ipfs="/ip4/127.0.0.1/tcp/5001", min_workers=3) as grid:
            w0, w1, w2 = grid.workers
            print((torch.ones(3).send(w0) + 1).get())
    """
    trusted = load_trust(trust) if trust is not None else None
    transport = open_transport(
        GridTransport,
        ipfs,
        deliver_own=True,  # a worker may share this node
        progress=wanted(progress),
        # with `trust`, nothing from another peer is even opened, on any topic
        allow=trusted_peers(trusted) if trusted is not None else None,
        closed_discovery=True,
    )
    return grid_over(
        transport,
        trust=trusted,
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
    trust: Trust | None = None,
) -> Grid:
    """`connect` on a transport you built (tests wrap it to drop or repeat messages).

    The grid owns `transport` from here on: closing the grid, or a failure here, closes it.
    """
    try:
        if type(min_workers) is not int or min_workers < 1:
            raise ValueError(f"min_workers must be a positive int, got {min_workers!r}")
        directory = Directory(dead_after, trust=trust, subscribed=subscription_probe(transport))
        transport.directory = directory  # whom to seal a worker's messages for
        transport.subscribe(DISCOVERY_TOPIC, directory.on_message)
        ask_workers(transport)
        names = directory.wait(
            min_workers, timeout, workers, settle=HEARTBEAT, where=where, pin=True
        )
        client = Client(
            transport,
            names,
            retry_after=retry_after,
            alive=directory.alive,
            message_limit=directory.max_message,
            cost=CostModel.pubsub(),
            memory_cap=memory_cap,
        )
        # The first replies may go out before the workers' nodes learn of our reply topic: one
        # quick round trip each, resent often, makes sure the grid answers before it is used.
        client.retry_after, default_timeout = 0.25, client.timeout
        client.timeout = timeout if workers is not None else min(timeout, PING_TIMEOUT)
        silent = _silent(client, names)
        client.retry_after, client.timeout = retry_after, default_timeout
        if silent and workers is not None:
            raise next(iter(silent.values()))
        if len(names) - len(silent) < min_workers:
            raise GridError(
                f"{len(names) - len(silent)} of the workers found on {where} answered, fewer "
                f"than min_workers={min_workers}; silent: {', '.join(silent)}"
            )
        if silent:  # announced, but not answering: someone's stale or squatted name
            log.warning("left out workers that did not answer: %s", ", ".join(silent))
            names = client.workers = [n for n in names if n not in silent]
    except BaseException:
        transport.close()
        raise
    keepalive = _KeepAlive(client, directory, lease, new_names=workers is None)
    keepalive.start()
    log.info("connected to %d workers on %s: %s", len(names), where, ", ".join(names))
    return Grid(client, on_close=keepalive.stop.set)


def _silent(client: Client, names: list[str]) -> dict[str, Exception]:
    """Ping every worker at once: the ones that did not answer within the client's timeout,
    each with its error."""
    silent: dict[str, Exception] = {}

    def ping(name: str) -> None:
        try:
            client.request(name, {"kind": "ping"}, counted=False)
        except Exception as e:  # (GridError, WorkerLost, RemoteError ...)
            silent[name] = e

    threads = [threading.Thread(target=ping, args=(n,), daemon=True) for n in names]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return silent


class _KeepAlive(threading.Thread):
    """Pings each worker at a third of its lease (`lease`: the same for all), so an idle
    grid keeps its tensors."""

    def __init__(
        self, client: Client, directory: Directory, lease: float | None, new_names: bool
    ) -> None:
        super().__init__(name=f"gridgraph-keepalive-{client.session}", daemon=True)
        self.client, self.directory, self.lease = client, directory, lease
        self.new_names = new_names  # whether workers not connected to may join
        self.intervals = {w: self._interval(w) for w in client.workers}
        self.stop = threading.Event()
        self._joining: set[str] = set()  # names being pinged before they join

    def _interval(self, worker: str) -> float:
        return max(MIN_PING_INTERVAL, (self.lease or self.directory.lease([worker])) / 3)

    def run(self) -> None:
        due = {w: time.monotonic() + interval for w, interval in self.intervals.items()}
        while True:
            wait = min([*due.values(), time.monotonic() + HEARTBEAT]) - time.monotonic()
            if self.stop.wait(max(0.0, wait)):
                return
            for name in self._admit():
                self.intervals[name] = self._interval(name)
                due[name] = time.monotonic() + self.intervals[name]
            for w, at in due.items():
                if self.client.closed or self.stop.is_set():
                    return
                if at > time.monotonic():
                    continue
                due[w] = time.monotonic() + self.intervals[w]
                if not self.directory.alive(w):
                    continue
                # A stats request: read-only, and kept out of the traffic counts on both ends.
                msg = {
                    "kind": "stats",
                    "id": uuid.uuid4().hex,
                    "session": self.client.session,
                    "free": [],
                }
                try:
                    self.client.transport.publish(worker_topic(w), wire.encode(msg), False)
                except Exception as e:  # closed under us, or Kubo is down: try next time
                    log.debug("keepalive to %s failed: %s", w, e)

    def _admit(self) -> list[str]:
        """Start pinging the workers heard since connect (a thread each: a squatted name
        never answers); returns those whose ping came back, now in the grid."""
        joined = [n for n in list(self._joining) if n in self.client.workers]
        self._joining.difference_update(joined)
        for name, fresh in self.directory.joiners(self.new_names):
            if name not in self._joining and not self.client.closed:
                self._joining.add(name)
                threading.Thread(target=self._join, args=(name, fresh), daemon=True).start()
        return joined

    def _join(self, name: str, fresh: bool) -> None:
        if fresh:  # (before it is pinned: the old process's values are not taken for its)
            lost.replaced(self.client, name)
        self.directory.pin([name])  # (its messages are sealed for this endpoint from here)
        self.client.requests.add_worker(name)
        try:
            self.client.requests.call(name, {"kind": "ping"}, counted=False)
        except Exception as e:  # silent, or refusing: someone's stale or squatted name
            log.warning("worker %s announced itself but did not answer: %s", name, e)
            self._joining.discard(name)
            return
        lost.join(self.client, name)
        log.info("worker %s joined the grid%s", name, " (a new process)" if fresh else "")
