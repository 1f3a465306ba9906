"""Workers a client lost, workers that join it, and what a loss takes with it.

State (the client's, under its run lock):
    workers    the workers in use: placement places new work on these only
    lost       worker name -> when it was found lost (time.monotonic()); out of `workers`

Policy:
- A worker is lost when a request to it ends unanswered while `alive` says it is gone (its
  heartbeats stopped, or on a local grid it was stopped): `Requests` then calls `lost`,
  which takes it out of `workers`, drops the cached plans that name it and describes for
  `WorkerLost` the values really gone with it, by the names the user gave them: those
  stored there, and those a run in flight was making there. Nothing else is failed by the
  loss itself.
- A run that names a lost worker is refused before anything of it is sent (`check`), with
  `WorkerLost`: nothing ran, so every pointer its recording rebound to a new version goes
  back to the version stored before (`roll_back`): a failed step leaves the values on the
  other workers readable as they were. A run that failed once sent leaves its values failed
  (a worker may have run part of it).
- A lost worker that `alive` says is back (the same process, its session intact: a pause)
  is used again, with its values. A worker new to the client joins through `join` (the
  transport's directory calls it); one back under a known name as another process is
  `replaced` first: a new worker, nothing of the old one assumed there, the old one's
  values failed with `WorkerLost`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol

from gridgraph.errors import RemoteError, WorkerLost
from gridgraph.exec.client.inflight import InFlight
from gridgraph.exec.client.requests import LOST_HINT, Requests
from gridgraph.schedule.cache import PlanCache
from gridgraph.schedule.plan import Plan
from gridgraph.trace.graph import Graph, Node


class Client(Protocol):
    """What of a client (exec/client/client.py) this module reads and changes."""

    workers: list[str]
    lost: dict[str, float]
    graph: Graph
    live: dict[int, Any]  # value id -> the cell of the pointer naming it
    failed: dict[int, RemoteError | WorkerLost]
    plans: PlanCache
    in_flight: InFlight
    requests: Requests
    alive: Callable[[str], bool]
    _programs_sent: dict[str, set[int]]

    def exclusive(self) -> AbstractContextManager: ...


def lost(client: Client, worker: str) -> list[str]:
    """Note that `worker` stopped answering (`Requests` calls this before it raises
    `WorkerLost`); returns the values gone with it, for the error."""
    with client.exclusive():
        if worker in client.workers:
            client.workers.remove(worker)
            client.lost.setdefault(worker, time.monotonic())
            client.plans.drop_naming(worker)
        return gone_with(client, worker)


def gone_with(client: Client, worker: str) -> list[str]:
    """The values live pointers name that were lost with `worker`: stored there, or being
    made there by a run in flight. Each as `name (shape) dtype`, by the user's names."""
    graph = client.graph
    made_there: set[int] = set()
    for run in client.in_flight.runs:
        for stage in run.plan.programs.get(worker, ()):
            for step in stage:
                for slot in getattr(step, "outs", ()):
                    made_there.add(run.slots[slot])
    # A pending value is gone with the storage it writes (a parameter's next version).
    stored_there = {v.storage for v in list(graph.values.values()) if v.location == worker}
    gone = []
    for vid in list(client.live):  # (a snapshot: other threads record meanwhile)
        value = graph.values.get(vid)
        if value is not None and (
            value.location == worker
            or vid in made_there
            or value.location is None
            and value.storage in stored_there
        ):
            gone.append(f"{graph.label(vid)} {tuple(value.meta.shape)} {value.meta.dtype}")
    return gone


def error(client: Client, worker: str) -> WorkerLost:
    """The `WorkerLost` for a lost worker, naming what is gone and what to do."""
    return WorkerLost(worker, gone_with(client, worker), LOST_HINT)


def usable(client: Client) -> list[str]:
    """The workers placement may use now: those in use, and any lost one that is alive again
    (the same process: its values are still there), which is back in use from here."""
    for worker in list(client.lost):
        if client.alive(worker):
            del client.lost[worker]
            client.workers.append(worker)
    return client.workers


def check(client: Client, plan: Plan) -> None:
    """Raise `WorkerLost` before anything is sent if `plan` names a worker found lost, or
    one a request would now find lost (`Requests.gone`)."""
    for worker in plan.programs:
        if worker in client.lost and worker not in usable(client):
            raise error(client, worker)
        if client.requests.gone(worker):
            return_lost = lost(client, worker)
            raise WorkerLost(worker, return_lost, LOST_HINT)


def roll_back(client: Client, nodes: list[Node]) -> None:
    """Point every live pointer that names a new version made by `nodes` (which never ran)
    back at the version of its storage stored before them, if one is known."""
    values = client.graph.values
    made = {vid for node in nodes for vid in node.outputs}
    stored: dict[tuple, int] = {}  # (storage, meta) -> a value stored with them
    for vid, value in list(values.items()):
        if value.location is not None and vid not in client.failed:
            stored.setdefault((value.storage, value.meta), vid)
    for vid in [v for v in client.live if v in made]:
        value = values.get(vid)
        before = stored.get((value.storage, value.meta)) if value is not None else None
        if before is None or before in client.live:
            continue
        cell = client.live.pop(vid)
        cell.vid = before
        client.live[before] = cell
        pointer = cell.ref()
        if pointer is not None:
            pointer._vid = before


def replaced(client: Client, worker: str) -> None:
    """`worker` is another process now (a restart, or a new owner of the name): none of the
    old one's values, programs or requests are there. Its values fail with `WorkerLost`."""
    with client.exclusive():
        gone = WorkerLost(worker, gone_with(client, worker), LOST_HINT)
        for vid, value in list(client.graph.values.items()):
            if value.location == worker:
                value.location = None
                client.failed[vid] = gone
        client.plans.drop_naming(worker)
        client._programs_sent[worker] = set()
        client.requests.add_worker(worker, fresh=True)


def join(client: Client, worker: str) -> None:
    """Use `worker` for new plans from now on (it answered; `replaced` first if it is
    another process under a name this client knew)."""
    with client.exclusive():
        client.lost.pop(worker, None)
        client.requests.add_worker(worker)
        client._programs_sent.setdefault(worker, set())
        if worker not in client.workers:
            client.workers.append(worker)
