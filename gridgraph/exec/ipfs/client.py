"""The client side of a grid over Kubo: `connect()`, and the keep-alive that holds its lease.

A client finds workers through the discovery topic (discovery.py), pins the endpoint and
process instance behind each name (its messages for that name, and the identities its runs
name for it, stay those of the worker it connected to), and pings (a `stats` request, which
workers leave out of the traffic counts) every worker at a third of the workers' lease, so
an idle but open grid keeps its tensors; a client silent past the lease has them freed.
PubSub loses a message now and then: clients resend requests after `retry_after` (0.5 s,
backing off); every resent message carries its original id, so nothing runs twice.

Example:
    # shell: gridgraph ipfs up --nodes 3 --root /tmp/swarm; one `gridgraph worker` per node
    with connect("/ip4/127.0.0.1/tcp/5001", min_workers=3) as grid:
        x = torch.ones(3).send(grid.workers[0])
"""

from __future__ import annotations

import logging
import math
import threading
import uuid
from pathlib import Path

from gridgraph.exec import wire
from gridgraph.exec.client import Client
from gridgraph.exec.grid import Grid
from gridgraph.exec.ipfs.discovery import (
    DEAD_AFTER,
    HEARTBEAT,
    Directory,
    Trust,
    ask_workers,
    load_trust,
)
from gridgraph.exec.ipfs.progress import wanted
from gridgraph.exec.ipfs.transport import GridTransport, open_transport
from gridgraph.exec.transport import Transport
from gridgraph.exec.worker import DISCOVERY_TOPIC, worker_topic
from gridgraph.schedule.cost import CostModel

log = logging.getLogger("gridgraph.ipfs")

DEFAULT_API = "/ip4/127.0.0.1/tcp/5001"


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
    when named), then keeps every live one it heard; raises GridError after `timeout` s.
    `lease`: the silence after which workers free this client's tensors, as the client
    assumes it to ping them in time (default: the shortest lease they announce).
    `retry_after`: resend a request unanswered this long (then after 2x, 4x, ... up to 8x);
    PubSub loses about one message in a few hundred, and a worker answers a repeated request
    from its reply cache. `dead_after`: a worker unheard this long is lost (`WorkerLost`).
    `memory_cap`: bytes per worker (or per worker name) that placement keeps new tensors under.
    `trust`: the workers this client uses, {name: peer ID}, a list of peer IDs, or a file of
    either (discovery.load_trust; `gridgraph id --ipfs ADDR` prints a node's peer ID); other
    peers announcing workers are ignored. Default: any worker on the grid (an open grid).
    Every message and block is end-to-end encrypted either way (gridgraph.exec.secure).
    `progress`: a progress bar on stderr for payloads over 64 MiB (default: when stderr is a
    terminal).

    Example:
        with gg.connect(ipfs="/ip4/127.0.0.1/tcp/5001", min_workers=3) as grid:
            w0, w1, w2 = grid.workers
            print((torch.ones(3).send(w0) + 1).get())
    """
    trusted = load_trust(trust) if trust is not None else None
    transport = open_transport(
        GridTransport, ipfs, deliver_own=True, progress=wanted(progress)
    )  # deliver_own: a worker may share this node
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
        directory = Directory(dead_after, trust=trust)
        transport.directory = directory  # whom to seal a worker's messages for
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
