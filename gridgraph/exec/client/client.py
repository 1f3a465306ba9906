"""The client runtime: owns the pointers, compiles pending work and runs it on workers.

State:
    graph      pending nodes and the metadata of every value (gridgraph.trace.graph)
    live       value id -> cell of the pointer that names it now
    failed     value id -> the RemoteError that kept it from being computed
    workers    the workers in use; `lost`: those found lost (exec/client/lost.py)
    requests   the requests to the workers, their resends and replies, and the ids waiting
               to be freed (exec/client/requests.py)

The loop of `execute`: take what the targets need from the pending graph, place it, split it
into per-worker programs (gridgraph.schedule), send one message per worker, record where each
value now lives and drop what no one needs. `execute` and a compiled step's replay return
once the messages are sent; their replies are taken at the next sync point (`settle`, which
raises the first failure among them; exec/client/inflight.py has the policy).

Freed pointers only append to a queue (their weakref callback may run on any thread, any time);
the queue is drained at the start of the next request, so releases travel in batches.

gg.compile records and replays a step through `run_pending` and `replay`, under `exclusive()`.
"""

from __future__ import annotations

import functools
import itertools
import threading
import time
import uuid
import weakref
from collections import defaultdict, deque
from collections.abc import Callable, Hashable
from contextlib import AbstractContextManager
from typing import Any, NamedTuple

import torch

from gridgraph.errors import (
    GridError,
    PlacementError,
    RecordError,
    RemoteError,
    SessionLost,
    WorkerLost,
)
from gridgraph.exec import wire
from gridgraph.exec.client import lost
from gridgraph.exec.client.checks import check_no_local_parameter, check_transfers, hint_trace
from gridgraph.exec.client.inflight import MAX_IN_FLIGHT, InFlight, Run
from gridgraph.exec.client.moves import move_storages
from gridgraph.exec.client.requests import Requests
from gridgraph.exec.protocol import SESSION_GONE, UNKNOWN_PLAN, client_topic, worker_topic
from gridgraph.exec.transport import Transport
from gridgraph.exec.wire import DTYPES
from gridgraph.schedule.cache import PlanCache, signature
from gridgraph.schedule.cost import CostModel
from gridgraph.schedule.place import place, storage_moves
from gridgraph.schedule.plan import Plan, run_params, split
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
        max_in_flight: int = MAX_IN_FLIGHT,
    ) -> None:
        self.transport = transport
        self.workers = list(workers)
        self.lost: dict[str, float] = {}  # worker -> when found lost (exec/client/lost.py)
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
            on_lost=functools.partial(lost.lost, self),
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
        # Runs sent and not settled (asynchronous dispatch, exec/client/inflight.py).
        self.in_flight = InFlight(max_in_flight)
        self._released_after_runs: list[Cell] = []  # dead cells that runs in flight name
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
            if vid in self.in_flight.held:  # released once the runs naming it settled
                self._released_after_runs.append(cell)
                continue
            value = self.graph.values.get(vid)
            if value is None or vid in pending_inputs or value.producer in self.graph:
                continue  # pending: the plan frees it after its last use (or fails it)
            self.failed.pop(vid, None)
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
            check_no_local_parameter(node)
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
        if eager:  # (an op outside gg.trace() waits for its run, as torch's would)
            self._eager_ops += 1
            if self._eager_ops == EAGER_HINT_AFTER:
                hint_trace(node, EAGER_HINT_AFTER)
            self.execute(list(node.outputs), wait=True)

    def run_data_dependent(self, node: Node) -> tuple[OutputSpec, list[Any]]:
        self.check_open()
        if self.on_sync is not None:
            self.on_sync(f"{node.name}, whose result's shape depends on the data")
        self.graph.add(node)
        needed = self.graph.needed_for(node.inputs()) | {node.id}
        plan, _, replies = self._execute(needed, fetch=[], dynamic={node.id}, wait=True)
        node.meta["location"] = plan.placement[node.id]
        for reply in replies.values():
            for _, kind, metas, pyvals in reply.get("dynamic", ()):
                return OutputSpec(kind, tuple(_meta(m) for m in metas)), pyvals
        raise GridError(f"worker did not report the result of {node.name}")

    def fetch(self, vid: int) -> torch.Tensor:
        self.check_open()
        if self.on_sync is not None:
            self.on_sync("reading a remote value (.item(), bool(), .tolist(), .get(), if p:)")
        self.settle()
        if vid in self.prefetched:
            return self.prefetched[vid].clone()
        plan, _, replies = self._execute(self.graph.needed_for([vid]), fetch=[vid], wait=True)
        for reply in replies.values():
            for _, tensor in reply.get("returns", ()):
                return tensor
        raise GridError(f"no worker returned value %{vid}")

    def compute(self, pointers: list[RemoteTensor]) -> None:
        self.execute([p._vid for p in pointers])

    def execute(self, vids: list[int], wait: bool = False) -> None:
        """Run what these values need; they stay on the workers. Returns once the run is
        sent (unless `wait`): a failure is raised at the next sync point (`settle`)."""
        self.check_open()
        if self.on_sync is not None:
            self.on_sync("running pointers now (p.compute(), gg.compute, an op outside trace)")
        self._execute(self.graph.needed_for(vids), fetch=[], wait=wait)

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
        self,
        needed: set[int],
        fetch: list[int],
        dynamic: set[int] = frozenset(),
        wait: bool = False,
    ) -> RunResult:
        """Run `needed`; with `wait` (or a fetch, or a data-dependent op) settle every run in
        flight first and wait for this one's replies, else return once it is sent."""
        wait = wait or bool(fetch) or bool(dynamic)
        with self._lock:
            if wait:
                self.settle()
            for vid in fetch:
                if vid in self.failed:
                    raise self.failed[vid]
            self.release_dead()
            nodes = [self.graph.pending[n] for n in sorted(needed)]
            if not nodes and not fetch:
                return RunResult(Plan({}, [], [], {}), [], {})
            values = self.graph.values
            keep = self._keep(needed, nodes)
            for node in nodes:  # (never to run: their values fail with the same error)
                for vid in node.inputs():
                    if vid in self.failed:
                        self._forget_run(nodes, [], keep, self.failed[vid])
                        raise self.failed[vid]
            key, slots = signature(nodes, values, keep, fetch, dynamic)
            plan = None if dynamic else self.plans.get(key)
            if plan is None:
                try:
                    moves = storage_moves(nodes, values)
                    if moves:  # a cached plan never has split homes: only a miss can
                        move_storages(self, moves)
                        key, slots = signature(nodes, values, keep, fetch, dynamic)
                    placement = self.place(nodes, values, lost.usable(self))
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
            try:  # (a worker found lost: nothing is sent, and nothing ran)
                lost.check(self, plan)
            except WorkerLost as e:
                lost.roll_back(self, nodes)
                self._forget_run(nodes, slots, keep | set(self.live), e)
                raise
            if not wait:
                frees_on_error = [
                    (values[v].location, v)
                    for v in slots
                    if v not in keep and v in values and values[v].location is not None
                ]
                outputs = [v for n in nodes for v in n.outputs if v in keep]
                try:
                    self._dispatch(plan, slots, run_params(nodes), nodes=nodes,
                                   outputs=outputs, frees_on_error=frees_on_error)  # fmt: skip
                except (RemoteError, WorkerLost) as e:  # (sending it failed)
                    self._forget_run(nodes, slots, keep, e)
                    raise
                replies = {}
            else:
                try:
                    replies = self.run_plan(plan, slots, run_params(nodes), learn_as=learn_as)
                except (RemoteError, WorkerLost) as e:
                    self._forget_run(nodes, slots, keep, e)
                    raise
                except KeyboardInterrupt:  # cancelled: it may have run in part
                    self._forget_run(
                        nodes,
                        slots,
                        keep,
                        GridError("this value's run was cancelled (interrupted); compute it again"),
                    )
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
            return self._execute(set(self.graph.pending), fetch=fetch, wait=True)

    def replay(
        self,
        plan: Plan,
        slots: list[int],
        params: list[Any],
        where: dict[int, str],
        outputs: list[int],
        frees_on_error: list[tuple[str, int]],
    ) -> None:
        """Send a plan recorded by `run_pending` again over new values: `slots` names the
        value of each slot, `params` the run's parameters, `where` the user's file:line by
        slot (for errors). Returns once it is sent; its replies bring back the small results
        it returns (`prefetched`); if it fails, the values `outputs` names are failed ones,
        `frees_on_error` ((worker, value id)) are freed, and the next sync point raises.

        >>> client.replay(plan, new_slots, params, where, outputs, frees_on_error)
        """
        with self._lock:
            self._dispatch(plan, slots, params, where=where, outputs=outputs,
                           frees_on_error=frees_on_error, prefetch=True)  # fmt: skip

    def settle(self) -> None:
        """Take the replies of every run in flight, oldest first: the sync point. Raises
        the first failure among them (or one kept from a run settled earlier)."""
        with self._lock:
            try:
                while self.in_flight.runs:
                    self._settle_next()
            finally:
                self._dead.extend(self._released_after_runs)
                self._released_after_runs.clear()
            failure, self.in_flight.failure = self.in_flight.failure, None
            if failure is not None:
                raise failure

    def compile(self, vids: list[int], placement_fn=None) -> tuple[list[Node], dict, Plan]:
        """The plan that computing `vids` would run now, without running it (for explain)."""
        with self._lock:
            self.release_dead()
            needed = self.graph.needed_for(vids)
            nodes = [self.graph.pending[n] for n in sorted(needed)]
            place = placement_fn or self.place
            placement = place(nodes, self.graph.values, lost.usable(self))
            keep = self._keep(needed, nodes) | set(vids)
            return nodes, placement, split(nodes, placement, self.graph.values, keep)

    def _keep(self, needed: set[int], nodes: list[Node]) -> set[int]:
        """Values that must outlive this run: live pointers and inputs of later work."""
        keep = set(self.live)  # (snapshots: other threads record meanwhile)
        for nid, node in list(self.graph.pending.items()):
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

    def run_plan(
        self,
        plan: Plan,
        slots: list[int],
        params: list[Any],
        where: dict[int, str] | None = None,
        learn_as: Hashable | None = None,
    ) -> dict[str, dict]:
        """Send each worker its part (the program itself only the first time) and wait for
        the replies, once every run sent before it settled. `where`: the user's file:line by
        slot, for errors of runs without pending nodes. `learn_as`: for a plan run once and
        not kept, what its answer times are learned under (exec/resend.py; by default its
        id); nor is it noted as sent, since no run names it again."""
        self.settle()
        run = self._dispatch(plan, slots, params, where=where, learn_as=learn_as)
        try:
            return self._wait_run(run)
        except KeyboardInterrupt:
            self.cancel()
            self.requests.abandon(run.rids)
            raise
        finally:
            self.in_flight.pop()

    def _dispatch(self, plan: Plan, slots: list[int], params: list[Any], **run: Any) -> Run:
        """Send each worker its part of `plan` (the program itself only the first time) and
        note the run as in flight; first settle the oldest runs while a worker it goes to
        has `max_in_flight` (the failure of one is kept for the next sync point).

        Each message names the identity of every worker that worker's part sends to or
        receives from, as this client knows them: workers send and take transfers between
        those identities only, whatever their own view of the grid says. Runs go in order
        (`in_order`): a worker serves them as sent, whatever order they arrive in."""
        check_transfers(plan, slots, self.graph, self.requests.message_limit)
        while self.in_flight.full(plan.programs):
            self._settle_next()
        number = next(self._runs)
        msgs = {}
        for worker in plan.programs:
            msg = {
                "kind": "run",
                "run": number,
                "plan": plan.id,
                "slots": slots,
                "params": [[i, params[i]] for i in plan.params_of.get(worker, ())],
            }
            if plan.peers_of[worker]:
                msg["peers"] = {w: self.identity_of(w) for w in plan.peers_of[worker]}
            if plan.id not in self._programs_sent.setdefault(worker, set()):
                msg["program"] = plan.wire[worker]
            msgs[worker] = msg
        rids = {w: self.requests.send(w, msg, in_order=True) for w, msg in msgs.items()}
        if run.get("learn_as") is None:
            for w in msgs:  # (a later run names it only: the worker serves them in order)
                self._programs_sent[w].add(plan.id)
        self.last_plan, self.last_slots = plan, slots
        sent = Run(number, plan, slots, rids, msgs, **{"learn_as": None, **run},
                   sent_at=time.monotonic())  # fmt: skip
        self.in_flight.add(sent)
        return sent

    def _settle_next(self) -> None:
        """Take the replies of the oldest run in flight. If it failed, its values are failed
        ones and its failure is kept for the next sync point (the first one only: a later
        run's is most likely its consequence). Interrupted, every run in flight is
        cancelled (`cancel`) and KeyboardInterrupt goes on."""
        run = self.in_flight.runs[0]
        try:
            replies = self._wait_run(run)
        except (RemoteError, WorkerLost, GridError) as e:  # (GridError: it timed out)
            self.in_flight.pop()
            if self.in_flight.failure is None:
                self.in_flight.failure = e
            self._failed_run(run, self.in_flight.failure)
            return
        except KeyboardInterrupt:
            self.cancel()
            self._drop_in_flight()
            raise
        self.in_flight.pop()
        if run.prefetch and run.number == self.in_flight.latest:  # (else a later run may
            for reply in replies.values():  # have written to what it returned)
                for slot, tensor in reply.get("returns", ()):
                    self.prefetched[run.slots[slot]] = tensor

    def _failed_run(self, run: Run, error: BaseException) -> None:
        """What a run that failed leaves: its values failed ones, its inputs freed."""
        for vid in run.outputs:
            if vid in self.graph.values:
                self.failed[vid] = error
        for worker, vid in run.frees_on_error:
            self.free_later(worker, vid)

    def cancel(self) -> None:
        """Abort this client's runs on every worker: a run waiting or running stops before
        its next op, one queued is answered without running. Safe from any thread; the
        runs' waits then end with their errors (or `_drop_in_flight` gives them up)."""
        latest = self.in_flight.latest
        for w in list(self.workers):  # (a copy: another thread may find one lost)
            abort = {"kind": "abort", "upto": latest, "session": self.session}
            try:
                self.transport.publish(worker_topic(w), wire.encode(abort), False)
            except Exception:  # (the transport is closing): nothing runs there for us
                pass

    def _drop_in_flight(self) -> None:
        """Give up every run in flight without waiting (interrupted): its values are failed
        ones, its requests acknowledged, and the values its pointers released are freed."""
        cancelled = GridError(
            "this value's run was cancelled (interrupted) before it finished; compute it again"
        )
        while self.in_flight.runs:
            run = self.in_flight.pop()
            self.requests.abandon(run.rids)
            self._failed_run(run, cancelled)
        self._dead.extend(self._released_after_runs)
        self._released_after_runs.clear()

    def _wait_run(self, run: Run) -> dict[str, dict]:
        """The replies to `run`; raises RemoteError naming the op, worker and line of the
        first failure (or WorkerLost)."""
        plan, msgs, rids = run.plan, run.msgs, run.rids
        try:
            key = plan.id if run.learn_as is None else run.learn_as
            replies = self.requests.wait(key, rids, run.sent_at)
            # A worker that dropped the program (restart, or its cache is full) gets it again.
            again = {
                w: self.requests.send(w, {**msgs[w], "program": plan.wire[w]}, in_order=True)
                for w, reply in replies.items()
                if not reply.get("ok") and reply["error"].get("code") == UNKNOWN_PLAN
            }
            replies.update(self.requests.wait_all(again) if again else {})
        except WorkerLost:
            for w in rids:  # unblock the others, which may wait on the lost worker's sends
                if self.alive(w):
                    abort = {"kind": "abort", "run": run.number, "session": self.session}
                    try:  # (the WorkerLost is what the user gets, whatever the transport says)
                        self.transport.publish(worker_topic(w), wire.encode(abort))
                    except Exception:  # (their recv times out instead)
                        pass
            raise
        self.runs_done += 1
        self.run_seconds += time.monotonic() - run.sent_at
        for w, reply in replies.items():
            if not reply.get("ok") and run.learn_as is None:
                self._programs_sent[w].discard(plan.id)
        errors = [r["error"] for r in replies.values() if not r.get("ok")]
        if errors:
            root = next((e for e in errors if not e.get("upstream")), errors[0])
            raise self._remote_error(root, run.slots, run.where_of())
        return replies

    def identity_of(self, worker: str) -> str:
        """The transport identity of `worker` as this client knows it (on IPFS, from its
        directory, where `trust` and the pinned workers hold)."""
        identity = self.transport.recipient(worker_topic(worker))
        if identity is None and not self.alive(worker):  # (stopped: its topic is gone)
            lost.lost(self, worker)
            raise lost.error(self, worker)
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
        reads: list[str] = []
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
                reads = [self.graph.label(v) for v in dict.fromkeys(node.inputs())]
            if where_of:
                where = where_of.get(slot, where)
        return RemoteError(
            str(error.get("worker")),
            str(error.get("op", "")),
            str(error.get("message", "")),
            where,
            str(error.get("traceback", "")),
            reads,
        )

    # --- requests --------------------------------------------------------------------------

    def request(self, worker: str, msg: dict, counted: bool = True) -> dict:
        """Send one request and wait for its reply; raises RemoteError on an error reply."""
        if self.on_sync is not None:
            self.on_sync(f"a {msg['kind']!r} request to {worker} (gg.send, manual_seed, stats)")
        if msg["kind"] != "put":  # (a put names only new values: it need not wait for runs)
            self.settle()
        return self.requests.call(worker, msg, counted)

    # --- lifecycle -------------------------------------------------------------------------

    def check_open(self) -> None:
        """Raise GridError if this client is closed."""
        if self.closed:
            raise GridError("this grid is closed")

    def close(self) -> None:
        """Free every tensor of this client on every worker."""
        if self.closed:
            return
        failure = None
        try:
            self.settle()
        except (RemoteError, WorkerLost, GridError) as e:  # raised once the byes are sent
            failure = e
        for w in [*self.workers, *self.lost]:  # (a copy: a loss changes it)
            try:
                self.request(w, {"kind": "bye"})
            except (GridError, WorkerLost, SessionLost):  # gone already: nothing to free
                pass
        self.closed = True
        self.requests.close()  # (the byes freed everything)
        self.transport.close()
        if failure is not None:
            raise failure


def _meta(m: list) -> TensorMeta:
    dtype, shape, stride, offset = m
    return TensorMeta(tuple(shape), tuple(stride), offset, DTYPES[dtype])
