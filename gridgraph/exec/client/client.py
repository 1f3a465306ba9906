"""The client runtime: owns the pointers, compiles pending work and runs it on workers.

State:
    graph      pending nodes and the metadata of every value (gridgraph.trace.graph)
    live       value id -> cell of the pointer that names it now
    failed     value id -> the RemoteError that kept it from being computed
    requests   the requests to the workers, their resends and replies, and the ids waiting
               to be freed (exec/client/requests.py)

The loop of `execute`: take what the targets need from the pending graph, place it, split it
into per-worker programs (gridgraph.schedule), send one message per worker, wait for the
replies, then record where each value now lives and drop what no one needs.

Freed pointers only append to a queue (their weakref callback may run on any thread, any time);
the queue is drained at the start of the next request, so releases travel in batches.

gg.compile records and replays a step through `run_pending` and `replay`, under `exclusive()`.
"""

from __future__ import annotations

import functools
import itertools
import math
import threading
import time
import uuid
import warnings
import weakref
from collections import defaultdict, deque
from collections.abc import Callable, Hashable
from contextlib import AbstractContextManager
from typing import Any, NamedTuple

import torch

from gridgraph.errors import (
    GridError,
    GridHint,
    PlacementError,
    RecordError,
    RemoteError,
    SessionLost,
    WorkerLost,
)
from gridgraph.exec import wire
from gridgraph.exec.client.requests import Requests
from gridgraph.exec.protocol import SESSION_GONE, UNKNOWN_PLAN, client_topic, worker_topic
from gridgraph.exec.transport import Transport
from gridgraph.exec.wire import DTYPES
from gridgraph.schedule.cache import PlanCache, signature
from gridgraph.schedule.cost import CostModel
from gridgraph.schedule.place import place, storage_moves
from gridgraph.schedule.plan import Plan, run_params, split
from gridgraph.schedule.program import Free, Recv, Send, Step
from gridgraph.trace.graph import Graph, Node
from gridgraph.trace.meta import OutputSpec, TensorMeta, warm_up
from gridgraph.trace.pointer import RemoteTensor
from gridgraph.trace.record import on

SENDABLE_DTYPES = frozenset(DTYPES.values())  # what the wire format carries
EAGER_HINT_AFTER = 100  # ops run outside gg.trace() before a client hints at it, once

# Every client of this process (gg.compile looks for the ones a step records on).
CLIENTS: weakref.WeakSet[Client] = weakref.WeakSet()


class Cell:
    """The value id a pointer names, and a weak reference that queues the cell when the
    pointer dies (a weakref callback is much cheaper than weakref.finalize)."""

    __slots__ = ("vid", "ref", "queue")

    def __init__(self, vid: int, queue: deque | None = None) -> None:
        self.vid = vid
        self.queue = queue
        self.ref = None

    def died(self, _ref: weakref.ref) -> None:
        self.queue.append(self)


class RunResult(NamedTuple):
    """What a run ran: its plan, the value id of each of its slots, each worker's reply."""

    plan: Plan
    slots: list[int]
    replies: dict[str, dict]


class Client:
    """One user's side of a grid."""

    def __init__(
        self,
        transport: Transport,
        workers: list[str],
        *,
        timeout: float = 300.0,
        retry_after: float = 2.0,
        alive: Callable[[str], bool] = lambda worker: True,
        message_limit: Callable[[str], int | None] = lambda worker: None,
        cost: CostModel | None = None,
        memory_cap: int | dict[str, int] | None = None,
    ) -> None:
        self.transport = transport
        self.workers = list(workers)
        self.session = uuid.uuid4().hex[:12]
        self.topic = client_topic(transport.identity, self.session)
        # Requests to the workers: resent while their replies do not come (timeout,
        # retry_after and alive are its settings, read and set through this client).
        self.requests = Requests(
            transport,
            self.topic,
            self.session,
            workers,
            timeout=timeout,
            retry_after=retry_after,
            alive=alive,
            message_limit=message_limit,
            lost_values=self._values_on,
        )
        self.graph = Graph()
        self.live: dict[int, Cell] = {}
        self.failed: dict[int, RemoteError] = {}
        self.closed = False
        # The cost model the placement minimises: in-process links by default.
        self.cost = cost or CostModel.local()
        # memory_cap: bytes a worker may hold of what a run places there (one number, or per
        # worker name); a run that cannot fit raises PlacementError before anything is sent.
        self.place = functools.partial(place, cost=self.cost, memory_cap=memory_cap)
        self.plans = PlanCache()
        self.last_plan: Plan | None = None  # what the latest run ran (for debugging)
        self.last_slots: list[int] = []  # the value id of each of its slots
        # While gg.compile records a step: called with what is about to need a worker's
        # answer in the middle of the step (a sync point), which it refuses.
        self.on_sync: Callable[[str], None] | None = None
        # Values that came back with a compiled step's run (its small results): value id ->
        # tensor, until the next compiled step or a recorded write (exec/client/compile.py).
        self.prefetched: dict[int, torch.Tensor] = {}
        self._programs_sent: dict[str, set[int]] = {w: set() for w in workers}
        self._dead: deque[Cell] = deque()  # cells of pointers that died, to release
        self._runs = itertools.count(1)
        self._eager_ops = 0  # ops run one round trip each (outside gg.trace()), for a hint
        # Time: runs since the stats were reset, and the seconds spent waiting for them.
        self.runs_done, self.run_seconds = 0, 0.0
        self._lock = threading.RLock()  # one execution at a time per client
        CLIENTS.add(self)
        warm_up()  # what the first op's meta kernel imports, meanwhile

    # --- settings of the requests ----------------------------------------------------------

    @property
    def timeout(self) -> float:
        """Seconds a request may wait for its reply, resends included."""
        return self.requests.timeout

    @timeout.setter
    def timeout(self, seconds: float) -> None:
        self.requests.timeout = seconds

    @property
    def retry_after(self) -> float:
        """Seconds before a request without its reply is first sent again."""
        return self.requests.retry_after

    @retry_after.setter
    def retry_after(self, seconds: float) -> None:
        self.requests.retry_after = seconds

    @property
    def alive(self) -> Callable[[str], bool]:
        """Whether a worker looks alive (heartbeats on IPFS): a dead one fails at once."""
        return self.requests.alive

    @alive.setter
    def alive(self, alive: Callable[[str], bool]) -> None:
        self.requests.alive = alive

    # --- pointers --------------------------------------------------------------------------

    def make_pointer(self, vid: int, requires_grad: bool = False) -> RemoteTensor:
        p = RemoteTensor(self, vid, self.graph.values[vid].meta, requires_grad)
        cell = Cell(vid, self._dead)
        cell.ref = weakref.ref(p, cell.died)  # the cell (held in `live`) keeps the ref alive
        p._cell = cell
        self.live[vid] = cell
        return p

    def rebind(self, p: RemoteTensor, vid: int) -> None:
        """Point `p` at a new version of its tensor (after an in-place op)."""
        cell = p._cell
        self.live.pop(cell.vid, None)
        self._dead.append(Cell(cell.vid))  # the old version: free once nothing needs it
        cell.vid = p._vid = vid
        self.live[vid] = cell

    def discard(self, node: Node) -> None:
        """Forget a recorded node that will never run (its recording was undone)."""
        if node.id in self.graph:
            self.graph.remove({node.id})
        for vid in node.outputs:
            self.graph.values.pop(vid, None)
            self.failed.pop(vid, None)

    def location_of(self, vid: int) -> str | None:
        if self.closed:  # its workers freed every value
            return None
        value = self.graph.values.get(vid)
        return value.location if value is not None else None

    def release_dead(self) -> None:
        """Release values whose pointers died, unless pending work still reads them: their
        ids go with the next request to their worker (in a batch of their own once many
        wait). Each run, stats and gg.compile call it before they look at what is live."""
        if not self._dead:
            return
        pending_inputs = {v for n in self.graph.nodes() for v in n.inputs()}
        released: defaultdict[str, list[int]] = defaultdict(list)  # worker -> value ids
        while self._dead:
            cell = self._dead.popleft()
            vid = cell.vid
            if vid is None:
                continue
            if self.live.get(vid) is cell:
                del self.live[vid]
            elif vid in self.live:
                continue  # another pointer names this value now
            self.failed.pop(vid, None)
            value = self.graph.values.get(vid)
            if value is None or vid in pending_inputs or value.producer in self.graph:
                continue  # pending: the plan frees it after its last use
            if value.location is not None:
                released[value.location].append(vid)
            del self.graph.values[vid]
        self.requests.free(released)

    def free_later(self, worker: str, vid: int) -> None:
        """Free value `vid` on `worker` with the next request there (the value of a failed
        run that nothing will read)."""
        self.requests.free_later(worker, [vid])

    # --- recording hooks (gridgraph.trace.record.Owner) -----------------------------------

    def record(self, node: Node, eager: bool) -> None:
        self.check_open()
        if node.params and torch.is_grad_enabled():  # (a local tensor is a parameter)
            _check_no_local_parameter(node)
        if self.prefetched and node.writes:
            self.prefetched.clear()  # the write may reach a prefetched value's storage
        values = self.graph.values
        for vid in node.outputs:
            dtype = values[vid].meta.dtype
            if dtype not in SENDABLE_DTYPES:
                raise RecordError(
                    f"{node.name} makes a tensor of dtype {dtype}, which workers cannot hold "
                    f"or send (they take {', '.join(DTYPES)})"
                )
        self.graph.add(node)
        if eager:
            self._eager_ops += 1
            if self._eager_ops == EAGER_HINT_AFTER:
                _hint_trace(node)
            self.execute(list(node.outputs))

    def run_data_dependent(self, node: Node) -> tuple[OutputSpec, list[Any]]:
        self.check_open()
        if self.on_sync is not None:
            self.on_sync(f"{node.name}, whose result's shape depends on the data")
        self.graph.add(node)
        needed = self.graph.needed_for(node.inputs()) | {node.id}
        plan, _, replies = self._execute(needed, fetch=[], dynamic={node.id})
        node.meta["location"] = plan.placement[node.id]
        for reply in replies.values():
            for _, kind, metas, pyvals in reply.get("dynamic", ()):
                return OutputSpec(kind, tuple(_meta(m) for m in metas)), pyvals
        raise GridError(f"worker did not report the result of {node.name}")

    def fetch(self, vid: int) -> torch.Tensor:
        self.check_open()
        if vid in self.prefetched:
            return self.prefetched[vid].clone()
        if self.on_sync is not None:
            self.on_sync("reading a remote value (.item(), bool(), .tolist(), .get(), if p:)")
        plan, _, replies = self._execute(self.graph.needed_for([vid]), fetch=[vid])
        for reply in replies.values():
            for _, tensor in reply.get("returns", ()):
                return tensor
        raise GridError(f"no worker returned value %{vid}")

    def compute(self, pointers: list[RemoteTensor]) -> None:
        self.execute([p._vid for p in pointers])

    def execute(self, vids: list[int]) -> None:
        """Run what these values need; they stay on the workers."""
        self.check_open()
        if self.on_sync is not None:
            self.on_sync("running pointers now (p.compute(), gg.compute, an op outside trace)")
        self._execute(self.graph.needed_for(vids), fetch=[])

    def compute_all(self) -> None:
        """Run every pending node."""
        self._execute(set(self.graph.pending), fetch=[])

    def move(self, p: RemoteTensor, worker: Any) -> None:
        """Copy `p`'s value to `worker` (a WorkerRef of this grid) and repoint `p` there."""
        grid = getattr(worker, "grid", None)
        if grid is None or grid.client is not self:
            raise GridError(f"{worker!r} is not a worker of this grid")
        worker = worker.name
        with torch.no_grad(), on(worker):
            copy = torch.ops.aten.clone.default(p)
        self.execute([copy._vid])
        vid = copy._vid
        copy._cell.vid = None  # `p` takes over the copy's value
        self.live.pop(vid, None)
        self.rebind(p, vid)

    # --- running ---------------------------------------------------------------------------

    def _execute(
        self, needed: set[int], fetch: list[int], dynamic: set[int] = frozenset()
    ) -> RunResult:
        with self._lock:
            for vid in fetch:
                if vid in self.failed:
                    raise self.failed[vid]
            self.release_dead()
            nodes = [self.graph.pending[n] for n in sorted(needed)]
            if not nodes and not fetch:
                return RunResult(Plan({}, [], [], {}), [], {})
            for node in nodes:
                for vid in node.inputs():
                    if vid in self.failed:
                        raise self.failed[vid]
            values = self.graph.values
            keep = self._keep(needed, nodes)
            key, slots = signature(nodes, values, keep, fetch, dynamic)
            plan = None if dynamic else self.plans.get(key)
            if plan is None:
                try:
                    moves = storage_moves(nodes, values)
                    if moves:  # a cached plan never has split homes: only a miss can
                        self._move_storages(moves)
                        key, slots = signature(nodes, values, keep, fetch, dynamic)
                    placement = self.place(nodes, values, self.workers)
                except PlacementError as e:
                    self._forget_run(nodes, [], keep, e)  # nothing ran: no frees either
                    raise
                plan = split(nodes, placement, values, keep, fetch, dynamic, slots)
                plan.id = self.plans.new_id()
                if not dynamic:
                    self.plans.put(key, plan)
            self.last_plan, self.last_slots = plan, slots
            # (a data-dependent op's plan is made anew each run: its answer times are
            # learned under what it runs, not its fresh id)
            learn_as = ("data-dependent", hash(key)) if dynamic else None
            try:
                replies = self._run_plan(plan, slots, run_params(nodes), learn_as=learn_as)
            except (RemoteError, WorkerLost) as e:
                self._forget_run(nodes, slots, keep, e)
                raise
            for node, w in zip(nodes, plan.node_workers):
                for vid in node.outputs:
                    value = values.get(vid)
                    if value is not None:
                        value.location, value.producer = w, None
            self.graph.remove(needed)
            for vid in slots:
                if vid not in keep:
                    values.pop(vid, None)
            return RunResult(plan, slots, replies)

    # --- capture and replay (gg.compile, exec/client/compile.py) ---------------------------

    def exclusive(self) -> AbstractContextManager:
        """Hold this client's run lock (re-entrant): no other thread runs anything on it
        meanwhile, so what a step reads stays as it was checked.

        >>> with client.exclusive():
        ...     client.release_dead()
        """
        return self._lock

    def run_pending(self, fetch: list[int]) -> RunResult:
        """Run every pending node as one plan (a step gg.compile records), bringing back the
        values `fetch` names with the replies.

        >>> plan, slots, replies = client.run_pending(fetch=[loss._vid])
        """
        with self._lock:
            return self._execute(set(self.graph.pending), fetch=fetch)

    def replay(
        self, plan: Plan, slots: list[int], params: list[Any], where: dict[int, str]
    ) -> dict[str, dict]:
        """Run a plan recorded by `run_pending` again over new values: `slots` names the
        value of each slot, `params` the run's parameters, `where` the user's file:line by
        slot (for errors). Each worker's reply; raises as a run does.

        >>> replies = client.replay(plan, new_slots, params, where)
        """
        with self._lock:
            replies = self._run_plan(plan, slots, params, where)
            self.last_plan, self.last_slots = plan, slots
            return replies

    def _move_storages(self, moves: dict[int, str]) -> None:
        """Move stored tensors (storage -> worker) straight from worker to worker, keeping
        their value ids, so that pending nodes naming them need no change.

        A storage moves only when one value is all that is known of it and it covers its
        storage densely from offset 0: the copy a worker receives is contiguous, and two
        views of one storage would arrive as two separate tensors.
        """
        values = self.graph.values
        by_storage: dict[int, list[int]] = {s: [] for s in moves}
        for vid, value in values.items():
            if value.storage in by_storage and value.location is not None:
                by_storage[value.storage].append(vid)
        group: dict[tuple[str, str], list[int]] = defaultdict(list)  # (src, dst) -> slots
        slots: list[int] = []
        for storage, dst in moves.items():
            vid, *others = by_storage[storage]
            src, meta = values[vid].location, values[vid].meta
            if others or meta.offset or not _dense(meta):
                raise PlacementError(
                    f"an op views or writes tensors stored on {src!r} and {dst!r}, which must "
                    f"then be one tensor on one worker, and %{vid} {tuple(meta.shape)} on {src!r}"
                    " shares its storage with other tensors; move it first (pointer.move(w))"
                )
            slots.append(vid)
            group[(src, dst)].append(len(slots) - 1)
        steps: dict[str, list[Step]] = defaultdict(list)
        for (src, dst), moved in group.items():  # one message from each worker to each other
            steps[src].extend([Send(moved, dst), *(Free(slot) for slot in moved)])
            steps[dst].append(Recv(moved, src))
        plan = Plan({w: [s] for w, s in steps.items()}, slots, [], {})
        plan.id = self.plans.new_id()  # run once, never cached
        self._run_plan(plan, slots, [], learn_as="storage move")
        for storage, dst in moves.items():
            values[by_storage[storage][0]].location = dst

    def compile(self, vids: list[int], placement_fn=None) -> tuple[list[Node], dict, Plan]:
        """The plan that computing `vids` would run now, without running it (for explain)."""
        with self._lock:
            self.release_dead()
            needed = self.graph.needed_for(vids)
            nodes = [self.graph.pending[n] for n in sorted(needed)]
            place = placement_fn or self.place
            placement = place(nodes, self.graph.values, self.workers)
            keep = self._keep(needed, nodes) | set(vids)
            return nodes, placement, split(nodes, placement, self.graph.values, keep)

    def _keep(self, needed: set[int], nodes: list[Node]) -> set[int]:
        """Values that must outlive this run: live pointers and inputs of later work."""
        keep = set(self.live)
        for nid, node in self.graph.pending.items():
            if nid not in needed:
                keep.update(node.inputs())
        for node in nodes:
            if node.returns == "":  # data-dependent: pointers are made after the run
                keep.update(node.outputs)
        return keep

    def _forget_run(self, nodes: list[Node], slots: list[int], keep: set[int], error: Exception):
        """After a failed run: its outputs are failed values, its nodes are gone."""
        for node in nodes:
            for vid in node.outputs:
                if vid in self.graph.values:
                    self.graph.values[vid].producer = None
                    self.failed[vid] = error
        self.graph.remove({n.id for n in nodes})
        for vid in slots:
            value = self.graph.values.get(vid)
            if vid not in keep and value is not None and value.location is not None:
                self.free_later(value.location, vid)

    def _run_plan(
        self,
        plan: Plan,
        slots: list[int],
        params: list[Any],
        where: dict[int, str] | None = None,
        learn_as: Hashable | None = None,
    ) -> dict[str, dict]:
        """Send each worker its part (the program itself only the first time) and wait.
        `where`: the user's file:line by slot, for errors of runs without pending nodes.
        `learn_as`: for a plan run once and not kept, what its answer times are learned
        under (exec/resend.py; by default its id); nor is it noted as sent, since no run
        names it again.

        Each message names the identity of every worker that worker's part sends to or
        receives from, as this client knows them: workers send and take transfers between
        those identities only, whatever their own view of the grid says."""
        self._check_transfers(plan, slots)
        run = next(self._runs)
        msgs = {}
        for worker in plan.programs:
            msg = {
                "kind": "run",
                "run": run,
                "plan": plan.id,
                "slots": slots,
                "params": [[i, params[i]] for i in plan.params_of.get(worker, ())],
            }
            if plan.peers_of[worker]:
                msg["peers"] = {w: self.identity_of(w) for w in plan.peers_of[worker]}
            if plan.id not in self._programs_sent[worker]:
                msg["program"] = plan.wire[worker]
            msgs[worker] = msg
        started = time.monotonic()
        rids = {w: self.requests.send(w, msg) for w, msg in msgs.items()}
        try:
            replies = self.requests.wait(plan.id if learn_as is None else learn_as, rids)
            # A worker that dropped the program (restart, or its cache is full) gets it again.
            again = {
                w: self.requests.send(w, {**msgs[w], "program": plan.wire[w]})
                for w, reply in replies.items()
                if not reply.get("ok") and reply["error"].get("code") == UNKNOWN_PLAN
            }
            replies.update(self.requests.wait_all(again) if again else {})
        except WorkerLost:
            for w in rids:  # unblock the others, which may wait on the lost worker's sends
                if self.alive(w):
                    self.transport.publish(
                        worker_topic(w),
                        wire.encode({"kind": "abort", "run": run, "session": self.session}),
                    )
            raise
        self.runs_done += 1
        self.run_seconds += time.monotonic() - started
        for w, reply in replies.items():
            if reply.get("ok") and learn_as is None:
                self._programs_sent[w].add(plan.id)
        errors = [r["error"] for r in replies.values() if not r.get("ok")]
        if errors:
            root = next((e for e in errors if not e.get("upstream")), errors[0])
            raise self._remote_error(root, slots, where)
        return replies

    def _check_transfers(self, plan: Plan, slots: list[int]) -> None:
        """Refuse, before anything runs, a plan whose transfer to a worker is larger than
        the messages that worker reads: it would drop it unread while the run waits."""
        for worker, stages in plan.programs.items():
            limit = self.requests.message_limit(worker)
            if limit is None:
                continue
            for step in (s for stage in stages for s in stage if isinstance(s, Recv)):
                values = [self.graph.values.get(slots[i]) for i in step.slots]
                sizes = [0 if v is None else math.prod(v.meta.shape) * v.meta.dtype.itemsize
                         for v in values]  # fmt: skip
                size = sum(sizes)
                if size > limit:
                    big = step.slots[sizes.index(max(sizes))]
                    raise GridError(
                        f"this run moves {size / 2**20:.1f} MiB from {step.worker!r} to "
                        f"{worker!r} in one message, over the {limit / 2**20:.1f} MiB "
                        f"{worker!r} reads (%{slots[big]} is the largest); keep the ops "
                        f"that read it on {step.worker!r} (with gg.on(...))"
                    )

    def identity_of(self, worker: str) -> str:
        """The transport identity of `worker` as this client knows it (on IPFS, from its
        directory, where `trust` and the pinned workers hold)."""
        identity = self.transport.recipient(worker_topic(worker))
        if identity is None:
            raise GridError(
                f"worker {worker!r} has no known identity on this transport, so no run may "
                "send it data or take data from it"
            )
        return identity

    def _remote_error(
        self, error: dict, slots: list[int], where_of: dict[int, str] | None = None
    ) -> RemoteError:
        if error.get("code") in SESSION_GONE:
            return SessionLost(str(error.get("worker")), str(error.get("message")))
        where = "<unknown>"
        slot = error.get("slot")
        if isinstance(slot, int) and slot < len(slots):
            vid = slots[slot]
            value = self.graph.values.get(vid)
            if value is not None and value.producer is not None:
                node = self.graph.pending.get(value.producer)
            else:  # a data-dependent call's outputs have no values until it has run
                node = next((n for n in self.graph.pending.values() if vid in n.outputs), None)
            if node is not None:
                where = node.meta.get("where", where)
            if where_of:
                where = where_of.get(slot, where)
        return RemoteError(
            str(error.get("worker")),
            str(error.get("op", "")),
            str(error.get("message", "")),
            where,
            str(error.get("traceback", "")),
        )

    # --- requests --------------------------------------------------------------------------

    def request(self, worker: str, msg: dict, counted: bool = True) -> dict:
        """Send one request and wait for its reply; raises RemoteError on an error reply."""
        if self.on_sync is not None:
            self.on_sync(f"a {msg['kind']!r} request to {worker} (gg.send, manual_seed, stats)")
        return self.requests.call(worker, msg, counted)

    def _values_on(self, worker: str) -> list[str]:
        """Describe the live values stored on `worker`, for WorkerLost."""
        lost = []
        for vid in self.live:
            value = self.graph.values.get(vid)
            if value is not None and value.location == worker:
                lost.append(f"%{vid} {tuple(value.meta.shape)} {value.meta.dtype}")
        return lost

    # --- lifecycle -------------------------------------------------------------------------

    def check_open(self) -> None:
        """Raise GridError if this client is closed."""
        if self.closed:
            raise GridError("this grid is closed")

    def close(self) -> None:
        """Free every tensor of this client on every worker."""
        if self.closed:
            return
        for w in self.workers:
            try:
                self.request(w, {"kind": "bye"})
            except (GridError, WorkerLost, SessionLost):  # gone already: nothing to free
                pass
        self.closed = True
        self.requests.close()  # (the byes freed everything)
        self.transport.close()


def _hint_trace(node: Node) -> None:
    """Say once, at the user's line, that many ops ran one round trip each."""
    where = node.meta.get("where", "<unknown>:0")
    filename, _, line = where.rpartition(":")
    warnings.warn_explicit(
        f"{EAGER_HINT_AFTER} ops on pointers ran one at a time, one round trip each (outside "
        "gg.trace()); record a step in `with gg.trace():` (or gg.compile it) to run it as "
        "one batch per worker: in the README's MLP, 100 ms a step instead of 587",
        GridHint,
        filename or where,
        int(line) if line.isdigit() else 0,
    )


def _check_no_local_parameter(node: Node) -> None:
    """Refuse an op that mixes a local `nn.Parameter` requiring grad with pointers (a model
    sent in part): its gradient would be a pointer, and the optimizer's step would fail far
    from here. Names the parameter as its model names it (`2.weight`)."""
    for arg in (*node.args, *node.kwargs.values()):
        for const in arg if isinstance(arg, list) else (arg,):
            source = getattr(const, "source", None)
            if isinstance(source, torch.nn.Parameter) and source.requires_grad:
                raise GridError(
                    f"{_unsent(source)} still local, and {node.name} at "
                    f"{node.meta.get('where', '<unknown>')} mixes one with pointers (its "
                    "gradient would be remote, and the optimizer's step would fail): send "
                    "them too (model.send(worker) sends every parameter of a model)"
                )


def _unsent(param: torch.nn.Parameter) -> str:
    """`parameters 2.weight, 2.bias of your Sequential are`: the local parameters of the
    outermost module holding `param`, by their dotted names, found through the garbage
    collector's referrers (on the error path only)."""
    import gc

    def holder(child: object, table: str) -> tuple[torch.nn.Module, str] | None:
        for d in gc.get_referrers(child):  # the module's table, then the module's __dict__
            if not isinstance(d, dict):
                continue
            for up in gc.get_referrers(d):
                for m in (up, *gc.get_referrers(up)) if isinstance(up, dict) else (up,):
                    if isinstance(m, torch.nn.Module) and vars(m).get(table) is d:
                        return m, next(k for k, v in d.items() if v is child)
        return None

    found = holder(param, "_parameters")
    if found is None:
        return f"parameter of shape {tuple(param.shape)} is"
    top, seen = found[0], {id(found[0])}
    while (up := holder(top, "_modules")) is not None and id(up[0]) not in seen:
        top, seen = up[0], seen | {id(up[0])}
    local = [n for n, p in top.named_parameters() if not isinstance(p, RemoteTensor)]
    if len(local) == 1:
        return f"parameter {local[0]} of your {type(top).__name__} is"
    return f"parameters {', '.join(local)} of your {type(top).__name__} are"


def _dense(meta: TensorMeta) -> bool:
    """Whether a tensor of this layout is contiguous (what a transfer delivers)."""
    expected = 1
    for size, stride in reversed(list(zip(meta.shape, meta.stride))):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _meta(m: list) -> TensorMeta:
    dtype, shape, stride, offset = m
    return TensorMeta(tuple(shape), tuple(stride), offset, DTYPES[dtype])
