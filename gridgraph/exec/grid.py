"""`Grid`: what a user holds: the workers, sending tensors and models, stats, closing.

`local_grid(n)` builds one in this process over a `LocalBus`; `connect()` (ipfs/client.py) builds
one over Kubo. Both hand a `Client` and worker names to `Grid`; nothing above the transport
differs.

State: `_module_tensors`, from each local parameter or buffer a module sent to the pointer
that replaced it (both held weakly). Policy: a tensor that modules share (weights tied as
`head.weight = embed.weight`) is sent once and every module gets the same pointer, whether
the modules go in one `send` or one after the other: one parameter, as `module.to()` keeps
it, on the worker it was first sent to.
"""

from __future__ import annotations

import math
import uuid
import weakref
from collections.abc import Callable

import torch
from torch.nn.modules.lazy import LazyModuleMixin
from torch.nn.parameter import UninitializedTensorMixin
from torch.utils.weak import WeakIdKeyDictionary

from gridgraph.errors import GridError, SessionLost, WorkerLost
from gridgraph.exec.client import lost
from gridgraph.exec.client.client import Client
from gridgraph.exec.isolation import executor
from gridgraph.exec.safety.limits import Limits
from gridgraph.exec.transport import LocalBus
from gridgraph.exec.wire import DTYPES
from gridgraph.exec.worker.worker import Worker
from gridgraph.trace import names, nested, scope
from gridgraph.trace.meta import TensorMeta, as_sent
from gridgraph.trace.pointer import RemoteTensor
from gridgraph.trace.record import on as _on
from gridgraph.trace.record import trace as _trace

PUT_OVERHEAD = 64 << 10  # bytes of a put message besides its tensors: header, frees
TENSOR_OVERHEAD = 4 << 10  # and per tensor: its header and alignment


class WorkerRef:
    """A worker of a grid, as the user names it: `grid.workers[0]`."""

    def __init__(self, grid: Grid, name: str) -> None:
        self.grid = grid
        self.name = name

    def manual_seed(self, seed: int) -> None:
        """Seed this worker's random ops (randn, dropout, ...)."""
        if type(seed) is not int:
            raise TypeError(f"seed must be an int, got {type(seed).__name__}")
        self.grid._check_open()
        self.grid.client.request(self.name, {"kind": "seed", "seed": seed})

    def __repr__(self) -> str:
        return f"<worker {self.name}>"


class Grid:
    """A set of workers and this process's client on them. Use as a context manager."""

    def __init__(
        self,
        client: Client,
        on_close: Callable[[], None] = lambda: None,
        local_workers: list[Worker] = (),
    ) -> None:
        self.client = client
        self._refs: dict[str, WorkerRef] = {}  # one WorkerRef per worker name
        self.local_workers = list(local_workers)  # the in-process runtimes, if any
        self._on_close = on_close
        self._module_tensors = WeakIdKeyDictionary()  # local tensor -> weakref to its pointer

    @property
    def workers(self) -> list[WorkerRef]:
        """The workers in use: a lost one leaves the list, one that joins comes in (a worker
        back under a lost one's name is a new worker: none of the old one's tensors)."""
        names = lost.usable(self.client) if not self.client.closed else self.client.workers
        return [self._refs.setdefault(n, WorkerRef(self, n)) for n in names]

    # --- sending ---------------------------------------------------------------------------

    def send(self, tensor: torch.Tensor, worker: WorkerRef) -> RemoteTensor:
        """Store `tensor` on `worker`; returns the pointer (keeps `requires_grad`). The
        pointer is called by the name your line gives it (`x = t.send(w)`: `x`)."""
        [p] = self.send_many([tensor], worker)
        name = names.tensor_name(tensor)
        if name is not None:
            self.client.graph.name(p._vid, name)
        return p

    def send_many(self, tensors: list[torch.Tensor], worker: WorkerRef) -> list[RemoteTensor]:
        """Several tensors to one worker: in one message, or in as few as fit the largest
        message the worker reads (announced: `gridgraph worker --max-message-size`); a tensor
        larger than that goes in pieces, joined there (`_send_in_pieces`)."""
        self._check_worker(worker)
        for t in tensors:
            check_sendable(t)
        limit = self.client.requests.message_limit(worker.name)
        room = None if limit is None else max(limit - PUT_OVERHEAD, limit // 2)
        sizes = [t.numel() * t.element_size() + TENSOR_OVERHEAD for t in tensors]
        if room is None or sum(sizes) <= room:
            return self._put(tensors, worker)
        pointers: list[RemoteTensor | None] = [None] * len(tensors)
        batch: list[int] = []
        for i, size in enumerate([*sizes, math.inf]):  # (the last one sends what is left)
            if batch and (size > room or sum(sizes[j] for j in batch) + size > room):
                for j, p in zip(batch, self._put([tensors[j] for j in batch], worker)):
                    pointers[j] = p
                batch = []
            if i == len(tensors):
                break
            if size > room:
                pointers[i] = self._send_in_pieces(tensors[i], worker, room - TENSOR_OVERHEAD)
            else:
                batch.append(i)
        return pointers

    def _send_in_pieces(self, t: torch.Tensor, worker: WorkerRef, room: int) -> RemoteTensor:
        """`t` as pieces of at most `room` bytes, each sent, then copied into a tensor made
        for it on `worker` (one run a piece; one piece there at a time, besides the tensor)."""
        flat = as_sent(t).reshape(-1)
        per = max(1, room // flat.element_size())
        whole = None
        with torch.no_grad(), _on(worker.name):
            for start in range(0, flat.numel(), per):
                [piece] = self._put([flat[start : start + per]], worker)
                with _trace():
                    if whole is None:
                        whole = piece.new_empty(t.shape)  # (a tensor of its own, not a view)
                    whole.view(-1)[start : start + per].copy_(piece)
                whole.compute()
                del piece  # freed with the next request
        return whole.requires_grad_(t.requires_grad)

    def _put(self, tensors: list[torch.Tensor], worker: WorkerRef) -> list[RemoteTensor]:
        """Tensors to one worker in one message."""
        graph = self.client.graph
        dense = [as_sent(t) for t in tensors]  # what arrives, and what its pointer says
        values = [graph.add_value(TensorMeta.of(t)) for t in dense]
        try:
            self.client.request(worker.name, {
                "kind": "put",
                "values": [[v.id, t] for v, t in zip(values, dense)],
            })  # fmt: skip
        except Exception:
            for v in values:
                del graph.values[v.id]
            raise
        for v in values:
            v.location = worker.name
        return [self.client.make_pointer(v.id, t.requires_grad) for v, t in zip(values, tensors)]

    def send_module(self, module: torch.nn.Module, worker: WorkerRef) -> torch.nn.Module:
        """Replace `module`'s parameters and buffers by pointers on `worker` (in place).
        They are called by their names in the module (`features.0.weight`), and ops in
        its forward and backward by the module call (`features.0 (Conv2d)`).

        A tensor shared with another module (tied weights) keeps one pointer: sent once, and
        where a module sent before took it along, that module's pointer (on its worker),
        under the name it was first sent by. A lazy module's parameters that its first call
        has yet to shape are sent when that call has made them, before it runs."""
        self._check_worker(worker)
        prefix = names.module_prefix()
        for path, m in module.named_modules():
            if isinstance(m, LazyModuleMixin) and m.has_uninitialized_params():
                self._send_when_initialized(m, worker, _joined(prefix, path))
        self._send_tensors(
            module, worker, prefix, lambda t: not isinstance(t, UninitializedTensorMixin)
        )
        scope.label_module(module, prefix)
        nested.follow_nested_fast_path(module)
        return module

    def _send_tensors(
        self,
        module: torch.nn.Module,
        worker: WorkerRef,
        prefix: str,
        which: Callable[[torch.Tensor], bool],
    ) -> None:
        slots = [(m, kind, name, t, _joined(prefix, path, name))
                 for path, m in module.named_modules()
                 for kind, table in (("param", m._parameters), ("buffer", m._buffers))
                 for name, t in table.items() if t is not None and which(t)]  # fmt: skip
        pointers: dict[int, RemoteTensor] = {}  # by id(local tensor); `slots` holds them
        for *_, t, _ in slots:
            ref = self._module_tensors.get(t)
            p = ref() if ref is not None else None
            if p is not None:
                pointers[id(t)] = p
        fresh = {id(t): (t, full_name) for *_, t, full_name in slots if id(t) not in pointers}
        sent = self.send_many([t for t, _ in fresh.values()], worker)
        graph = self.client.graph
        for (t, full_name), p in zip(fresh.values(), sent):
            pointers[id(t)] = p
            self._module_tensors[t] = weakref.ref(p)
            graph.name(p._vid, full_name)
        for m, kind, name, t, _ in slots:
            p = pointers[id(t)]
            if kind == "param":
                p._is_param = True  # what nn.Parameter does for tensor subclasses
                m._parameters[name] = p
            else:
                m._buffers[name] = p

    def _send_when_initialized(
        self, module: torch.nn.Module, worker: WorkerRef, prefix: str
    ) -> None:
        """After the lazy module's own hook shapes its parameters (at its first call,
        registered before this one), send them, once."""

        def send(m: torch.nn.Module, args: tuple) -> None:
            handle.remove()
            self._send_tensors(m, worker, prefix, lambda t: not isinstance(t, RemoteTensor))

        handle = module.register_forward_pre_hook(send)

    def _check_worker(self, worker: object) -> None:
        self._check_open()
        if not isinstance(worker, WorkerRef):
            raise TypeError(f"expected a worker (grid.workers[i]), got {type(worker).__name__}")
        if worker.grid is not self:
            raise GridError(f"{worker!r} belongs to another grid")

    def _check_open(self) -> None:
        if self.client.closed:
            raise GridError("this grid is closed")

    # --- stats -----------------------------------------------------------------------------

    def stats(self) -> dict:
        """Messages and bytes sent since the last reset, and what each worker holds now;
        `lost` maps each worker that did not answer (lost, or its session ended) to why.
        Time since the last reset: `runs` (each batch of work sent: a traced step, an op
        outside trace, a .get()), `run_s` the seconds this client waited for them, and per
        worker `busy_s`, the seconds it spent serving this client (the rest of `run_s` is
        the network, the queue, and waiting on other workers)."""
        self._check_open()
        return self._stats(reset=False)

    def reset_stats(self) -> None:
        """Start counting messages and bytes (and ops run) from zero."""
        self._check_open()
        self._stats(reset=True)

    def _stats(self, reset: bool) -> dict:
        self.client.settle()  # (what runs in flight hold is released once they settled)
        self.client.release_dead()
        per_worker = {}
        lost = {}
        messages = bytes_ = 0
        for w in [*self.client.workers, *self.client.lost]:  # (a copy: a loss changes it)
            try:
                reply = self.client.request(w, {"kind": "stats", "reset": reset}, counted=False)
            except (WorkerLost, SessionLost, GridError) as e:  # gone, or silent: say so
                lost[w] = str(e)
                continue
            per_worker[w] = {k: reply[k] for k in ("objects", "stored_bytes", "ops_run")}
            per_worker[w]["busy_s"] = reply.get("busy_seconds", 0.0)
            messages += reply["messages"]
            bytes_ += reply["bytes"]
        sent = self.client.transport.sent
        out = {
            "messages": messages + sent.messages,
            "bytes": bytes_ + sent.bytes,
            "workers": per_worker,
            "lost": lost,
            "runs": self.client.runs_done,
            "run_s": self.client.run_seconds,
        }
        if reset:
            sent.reset()
            self.client.runs_done, self.client.run_seconds = 0, 0.0
        return out

    def manual_seed(self, seed: int) -> None:
        """Seed every worker's random ops with `seed`."""
        for w in self.workers:
            w.manual_seed(seed)

    # --- runs in flight --------------------------------------------------------------------

    def sync(self) -> None:
        """Wait until every run sent so far has finished; raise the first failure among them
        (naming the op, the worker and your line). `.compute()`, `gg.compute(...)` and a
        compiled step return once their run is sent; reading a value (`.get()`, `.item()`,
        `bool()`, `.tolist()`) waits too, and so does leaving the `with` block.

        >>> for x, y in batches:
        ...     loss = step(x, y)  # returns at once; the workers set the pace
        >>> grid.sync()  # every step ran (or its failure is raised here)
        """
        self._check_open()
        self.client.settle()

    def cancel(self) -> None:
        """Cancel every run this client has sent: each stops between ops on its worker (one
        queued does not start), and a wait for one ends with `gg.RemoteError` saying it
        was cancelled. Safe from any thread (Ctrl-C during a wait does the same).

        >>> threading.Timer(60, grid.cancel).start()  # give up on what runs after a minute
        """
        self._check_open()
        self.client.cancel()

    @property
    def max_in_flight(self) -> int:
        """Runs a worker may have in flight from this client (default 8): past it, the next
        run waits for the oldest. Higher overlaps more steps and holds more memory."""
        return self.client.in_flight.max_in_flight

    @max_in_flight.setter
    def max_in_flight(self, runs: int) -> None:
        if type(runs) is not int or runs < 1:
            raise ValueError(f"max_in_flight is a positive int, got {runs!r}")
        self.client.in_flight.max_in_flight = runs

    # --- lifecycle -------------------------------------------------------------------------

    def close(self) -> None:
        """Wait for the runs in flight, free this client's tensors on every worker and stop;
        raises the first failure among those runs, once all is freed."""
        if self.client.closed:
            return
        try:
            self.client.close()
        finally:
            self._on_close()

    def __enter__(self) -> Grid:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is not None:  # an error is on its way already: it is the one raised
            try:
                self.close()
            except Exception:
                pass
            return
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.client.closed else "open"
        return f"<Grid {state}: {', '.join(w.name for w in self.workers)}>"


def bring_home(module: torch.nn.Module) -> torch.nn.Module:
    """Make a sent model local again, in place: each parameter, buffer and gradient that is
    a pointer becomes a local tensor holding its value on the worker now. Returns `module`.
    Optimizer state stays remote: make the optimizer again for the local parameters."""
    for m in module.modules():
        for table in (m._parameters, m._buffers):
            for name, t in table.items():
                if isinstance(t, RemoteTensor):
                    table[name] = _local(t, table is m._parameters)
    return module


def _local(p: RemoteTensor, param: bool) -> torch.Tensor:
    """The local copy of pointer `p` (with its `.grad`, if that is a pointer)."""
    t = p.get()
    if param:
        t = torch.nn.Parameter(t, requires_grad=p.requires_grad)
    if isinstance(p.grad, RemoteTensor):
        t.grad = p.grad.get()
    return t


def check_sendable(t: object) -> None:
    """Raise a clear error for anything that cannot be sent to a worker."""
    if isinstance(t, RemoteTensor):
        raise GridError("this tensor is already remote; use .move(worker) to move it")
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise GridError(f"tensor on device {t.device}: workers take CPU tensors; call .cpu()")
    if t.layout != torch.strided:
        raise GridError(f"tensor with layout {t.layout} cannot be sent; use a dense tensor")
    if str(t.dtype).removeprefix("torch.") not in DTYPES:
        raise GridError(f"tensors of dtype {t.dtype} cannot be sent")


def local_grid(
    n: int = 3,
    *,
    memory_cap: int | dict[str, int] | None = None,
    limits: Limits | None = None,
    isolate: bool = False,
) -> Grid:
    """A grid of `n` in-process workers named w0, w1, ... (the embedded default).

    `memory_cap`: bytes per worker (one number, or per worker name) that placement keeps
    the tensors it creates on a worker under. `limits`: the budgets each worker grants each
    client, as `gridgraph worker` does (default: none, since the grid serves only you):

        gg.local_grid(2, limits=Limits(max_client_memory=1 << 30, max_request_seconds=10))

    `isolate=True` runs each worker's programs in executor processes, as `gridgraph worker`
    does (see exec/isolation/executor.py); by default they run in this process.
    """
    if type(n) is not int or n < 1:
        raise ValueError(f"a local grid needs at least one worker, got {n!r}")
    limits = limits or Limits.unlimited()
    bus = LocalBus()
    names = [f"w{i}" for i in range(n)]
    if isolate:
        executor.refuse_nested_start()
    isolation = executor.Isolation() if isolate else None
    workers = [
        Worker(name, bus.endpoint(name), limits=limits, isolation=isolation) for name in names
    ]
    limit = limits.max_message_bytes if limits.max_message_bytes < 1 << 62 else None
    by_name = dict(zip(names, workers))
    client = Client(
        bus.endpoint(f"client-{uuid.uuid4().hex[:8]}"),
        names,
        memory_cap=memory_cap,
        message_limit=lambda worker: limit,
        alive=lambda name: name in by_name and not by_name[name].closed,  # (a stopped one: lost)
    )

    def stop_workers() -> None:
        for w in workers:
            w.close()

    return Grid(client, on_close=stop_workers, local_workers=workers)


def _joined(*parts: str) -> str:
    """A dotted name from its non-empty parts: `_joined("model", "", "weight")`."""
    return ".".join(p for p in parts if p)
