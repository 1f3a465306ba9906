"""`gg.compile(fn)`: a step recorded through `gg.trace()`, then replayed without its Python.

State, per compiled function: `_entries`, keyed by the guard of a call's arguments (their
types; a pointer's shape, dtype, location and grid; a local tensor's metadata; plain values
by value; containers by what they hold; other objects by identity; torch's grad mode,
autocast and default dtype), each holding the latest recording made under that guard and
the replays built from it (at most `MAX_REPLAYS`), whether a call under it has replayed and
how many have recorded since; `_warned`: whether the function has warned.

Policy: a call whose guard has a replay whose checks pass (guards.py: modules, optimizers,
frozen arguments, pinned pointers, external inputs as recorded) is replayed through the
client's `replay`: one run message per worker naming the cached plan, and nothing of `fn`
runs, is recorded or placed. Any other call is recorded (`run_pending`): `fn` runs under
`gg.trace()` and the step runs as one plan. Two consecutive recordings under one guard that
ran the same plan with the same effects make a replay; floats and local tensors that differ
between them are the step's arguments, or state outside `fn` (refused with `GridError`,
never replayed stale). The floats and local tensors in the param groups of the optimizers a
step ran (`lr`, set by an LR scheduler) count as arguments after the call's own. A function
that records again more than twice under a guard that replayed, or records four times without
replaying, warns once (`RecompileWarning`) with the guard or check that failed and the call's
line. `Compiled`'s docstring says what is refused while recording, and what a replay cannot
see. Compiled calls run one at a time, whatever the thread.
"""

from __future__ import annotations

import functools
import inspect
import threading
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_pre_hook

from gridgraph.errors import GridError, RemoteError, WorkerLost
from gridgraph.exec.client import lost
from gridgraph.exec.client.client import CLIENTS, Cell, Client
from gridgraph.exec.client.guards import (
    aliases,
    alive,
    autograd_state,
    by_identity,
    flatten,
    guard,
    hyperparameter_values,
    hyperparameters,
    modes,
    param_sources,
    referents,
    same,
    scalar,
    show,
    snapshot,
    state,
)
from gridgraph.schedule.plan import Plan, run_params
from gridgraph.trace.meta import TensorMeta, as_sent
from gridgraph.trace.pointer import RemoteTensor
from gridgraph.trace.record import trace, user_frame

# Returned tensors up to this size come back with the step's replies.
PREFETCH_BYTES = 64 * 1024
MAX_REPLAYS = 8  # per argument guard
MAX_GUARDS = 16  # argument guards per compiled function

_MISS = object()  # a replay's checks failed: record this call instead
_recording = threading.local()  # `active`: a compiled step is being recorded on this thread
# One compiled call at a time: a recording takes every op pending on the client as its step.
_calls = threading.RLock()

Source = int | Cell  # where a step reads a tensor: argument index, or the pointer's cell


class RecompileWarning(UserWarning):
    """A compiled step keeps recording (or never replays); the message says why."""


def compile(fn: Callable) -> Compiled:  # noqa: A001 - gg.compile, as torch.compile
    """Record `fn` once per guard set and replay it without running its Python.

    >>> @gg.compile
    ... def step(x, y):
    ...     opt.zero_grad()
    ...     loss = F.mse_loss(model(x), y)
    ...     loss.backward()
    ...     opt.step()
    ...     return loss
    >>> for _ in range(100):
    ...     print(step(x, y).item())
    """
    if not callable(fn):
        raise TypeError(f"gg.compile takes a function, got {type(fn).__name__}")
    return Compiled(fn)


class Compiled:
    """A compiled step: call it as `fn`. `recordings` and `replays` count the calls of each
    kind; `not_replayable` says why the latest recording cannot be replayed, if it cannot.

    Policy:
    1. A call whose guard has a replay whose checks pass (the same modules with the same
       settings (train/eval mode, `Dropout.p`), parameters, buffers, submodules and hooks; the
       same optimizer hyperparameters and parameters; the values of the arguments it froze;
       the pointer arguments it pinned; external inputs with the shapes, locations, aliasing,
       `requires_grad` and hooks recorded) is replayed:
       fresh value ids for what the step makes, one run message per worker naming the cached
       plan (workers run the programs they keep), then the pointers are rebound and attached as
       the recorded call left them. Nothing of `fn` runs, nothing is recorded, nothing is placed.
    2. Any other call is recorded: pending work is run first, `fn` runs under `gg.trace()`, and
       the whole step runs as one plan (small returned tensors come back with its replies, so
       reading the loss costs no message). The recording notes what the step reads (argument i,
       or the pointer that held it at the start), which pointers it rebinds (in-place updates),
       which new pointers it attaches (`.grad` of a leaf, set by autograd) and what it returns.
    3. Two consecutive recordings under one guard that ran the same plan (the plan cache gave
       them one id: same ops, shapes, locations and aliasing) with the same effects make a
       replay. A first step that creates state (grads, optimizer buffers) differs from the next,
       so replays start once the step is steady (the third call for SGD with momentum).
    4. Floats and local tensors reaching the ops are compared between the two recordings. One
       equal to a float or tensor argument in both, where that argument changed, is that
       argument; one equal in both is a constant. One that changed and is no argument is state
       outside `fn` (Adam's bias correction from its CPU step counter): `GridError` naming the op
       and line, never a replay of a stale value. Arguments that did not change, or reach the
       ops only through Python arithmetic, are frozen: another value records again. A pointer
       argument that was the same pointer in both recordings is pinned the same way (`fn` may
       also read it otherwise, through a closure). The floats and local tensors in the param
       groups of the optimizers the step ran (`lr`, `momentum`) are arguments too, read at
       each call: a learning rate an LR scheduler changes every step is replayed (taken as
       is, as the number a tensor `lr` holds, or negated, as SGD's `alpha=-lr`). An LR
       scheduler stepped inside `fn` makes the step not replayable (a replay runs no Python).
    5. Refused while recording, with `GridError` naming the user's line: reading a remote value
       in Python (`.item()`, `bool(p)`, `if p > 0:`), data-dependent shapes, running pointers or
       sending tensors inside `fn`. Pointers of two grids in one step are refused too.
    6. A function that records again more than twice after replaying, or four times without
       replaying, warns once (`gg.RecompileWarning`) naming the guard or check that failed
       and the line of the call.
    7. Compiled calls run one at a time, whatever the thread (a recording takes every op
       pending on the client as its step); another thread's request or read during a recording
       is its own (not refused). Ops that another thread records on the same grid while a step
       records join the step's plan.

    What replay cannot see: Python state that `fn` reads and that does not reach an op as a
    float or tensor, other than what `guards.state` covers (modules' settings, parameters,
    buffers, submodules and hooks; optimizers' hyperparameters and parameters) and each read
    pointer's `requires_grad` and hooks, is assumed to stay as it was in the recordings; Python
    effects of `fn` besides its ops do not happen. A float argument is matched by value, so
    Python that picks one (`max(lr, floor)`) passes for it while both recordings picked it.
    Pointers a replay returns are detached (no `grad_fn`): the backward pass ran inside the
    step, and a step that returns a tensor requiring grad without one is not replayed.
    """

    def __init__(self, fn: Callable) -> None:
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.recordings = self.replays = 0
        self.not_replayable: str | None = None
        self._entries: OrderedDict[tuple, _Entry] = OrderedDict()
        self._last_key: tuple | None = None
        self._warned = False  # a RecompileWarning is given once per compiled function

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if getattr(_recording, "active", False):
            return self.fn(*args, **kwargs)  # called from a step being recorded: part of it
        with _calls:
            return self._call(args, kwargs)

    def _call(self, args: tuple, kwargs: dict) -> Any:
        flat = flatten([*args, *(kwargs[k] for k in sorted(kwargs))])
        key = (
            len(args),
            tuple(sorted(kwargs)),
            *[guard(a) for a in flat],
            aliases(flat),
            *modes(),
        )
        entry = self._entries.get(key)
        why: str | None = None  # why this call records rather than replays, for the warning
        if entry is None:
            if self._last_key is not None:
                why = _guard_change(self._last_key, key, self._describe_argument)
            # Objects guarded by identity are held, so that no other object takes their id.
            entry = self._entries[key] = _Entry([a for a in flat if by_identity(a)])
            while len(self._entries) > MAX_GUARDS:
                self._entries.popitem(last=False)
        self._last_key = key
        for replay in entry.replays:
            inputs = replay.rec.arguments(flat)
            why = replay.mismatch(inputs)
            if why is None:
                result = replay.run(inputs)
                if result is _MISS:
                    why = "a pointer the step reads has another shape, worker or aliasing"
                else:
                    self.replays += 1
                    entry.replays_made = True
                    return result
        where = user_frame()
        result, rec = self._record(args, kwargs, flat)
        self.recordings += 1
        if rec is not None:
            self.not_replayable = rec.reason
            previous, entry.last = entry.last, rec
            if previous is not None:
                differs = _differs(previous, rec)
                if differs is None:
                    replay = _Replay(previous, rec, self.__name__, self._describe_argument)
                    entry.replays.insert(0, replay)
                    del entry.replays[MAX_REPLAYS:]
                why = why or rec.reason or differs
        if entry.replays_made:
            entry.rerecordings += 1
        again = entry.rerecordings > 2 or (self.recordings > 3 and not self.replays)
        if again and not self._warned:  # recorded again more than twice, or never replays
            self._warned = True
            warnings.warn(
                f"gg.compile({self.__name__}) has recorded {self.recordings} times and replayed "
                f"{self.replays} (called at {where}): {why or 'each call had new guards'}. A "
                "step replays once two calls in a row record the same plan; "
                "help(gg.Compiled) says what a replay checks.",
                RecompileWarning,
                stacklevel=3,
            )
        return result

    def _describe_argument(self, i: int, hyper: list | None = None) -> str:
        """Argument `i` of the flattened call, by the name `fn` gives it where it can (an
        optimizer's hyperparameter after the call's own arguments, when `hyper` is given)."""
        n_flat = len(self._last_key or ()) - 3 - len(modes())
        if hyper and i >= n_flat and i - n_flat < len(hyper):
            o, g, k = hyper[i - n_flat]
            return f"{type(o).__name__}.param_groups[{g}][{k!r}]"
        names = [
            p.name
            for p in inspect.signature(self.fn).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ] if callable(self.fn) else []  # fmt: skip
        return f"argument {names[i]!r}" if i < len(names) else f"argument {i}"

    def __repr__(self) -> str:
        calls = f"{self.recordings} recorded, {self.replays} replayed"
        return f"<gg.compile of {self.__name__}: {calls}>"

    # --- recording ---------------------------------------------------------------------------

    def _record(self, args: tuple, kwargs: dict, flat: list) -> tuple[Any, _Recording | None]:
        """Run `fn` traced, run its whole step as one plan, and note how to replay it."""
        owners = {id(a._owner): a._owner for a in flat if isinstance(a, RemoteTensor)}
        if len(owners) > 1:
            raise GridError(f"{self.__name__} takes pointers of two different grids")
        for owner in owners.values():
            owner.check_open()
        clients = [c for c in list(CLIENTS) if not c.closed]
        for c in clients:
            c.prefetched.clear()
            if c.graph.pending:
                c.compute_all()  # the step's plan holds the step's ops only
            c.release_dead()
        start = {c: dict(c.live) for c in clients}
        arg_of = {a._vid: i for i, a in enumerate(flat) if isinstance(a, RemoteTensor)}
        modules: dict[int, torch.nn.Module] = {}
        optimizers: dict[int, torch.optim.Optimizer] = {}
        at_step: dict[int, list] = {}
        name = self.__name__

        def refuse(what: str) -> None:
            if not getattr(_recording, "active", False):
                return  # another thread's: it runs what it needs, not this step's ops
            raise GridError(
                f"gg.compile({name}): {what} at {user_frame()}: a compiled step cannot branch "
                "on or wait for remote values; compute with tensors instead, or do this "
                "outside the compiled function"
            )

        def saw_module(m: torch.nn.Module, _: Any) -> None:
            modules.setdefault(id(m), m)

        def saw_optimizer(o: torch.optim.Optimizer, *_: Any) -> None:
            if id(o) not in optimizers:  # what its ops take: the values at its first step
                optimizers[id(o)] = o
                at_step[id(o)] = [snapshot(v) for v in hyperparameter_values(hyperparameters([o]))]

        hooks = [register_module_forward_pre_hook(saw_module),
                 register_optimizer_step_pre_hook(saw_optimizer)]  # fmt: skip
        for c in clients:
            c.on_sync = refuse
        _recording.active = True
        try:
            with trace():
                result = self.fn(*args, **kwargs)
        finally:
            _recording.active = False
            for h in hooks:
                h.remove()
            for c in clients:
                c.on_sync = None
        touched = [c for c in clients if c.graph.pending]
        if not touched:
            return result, None
        if len(touched) > 1:
            raise GridError(f"{name} records on two different grids in one step")
        client = touched[0]
        client.release_dead()  # pointers that died inside the step are no effect of it
        rec = _Recording(client, start[client], arg_of, flat)
        rec.watched = (list(modules.values()), list(optimizers.values()))
        rec.state = state(rec.watched)
        rec.take_hyperparameters([s for o in optimizers for s in at_step[o]])
        rec.referents = referents(rec.watched)
        rec.note_effects(result)
        rec.run()
        return result, rec


@dataclass(eq=False)
class _Entry:
    """The calls under one argument guard: the latest recording, and replays."""

    held: list[Any]
    last: _Recording | None = None
    replays: list[_Replay] = field(default_factory=list)
    replays_made: bool = False  # whether a call under this guard has replayed
    rerecordings: int = 0  # calls recorded since then


class _Recording:
    """One recorded call of a compiled step, in terms of its plan's slots."""

    def __init__(self, client: Client, start: dict[int, Cell], arg_of: dict, flat: list):
        self.client = client
        self.reason: str | None = None  # why this call cannot be replayed, if it cannot
        self.nodes = client.graph.nodes()
        values = client.graph.values
        self.produced = {v: n for n in self.nodes for v in n.outputs}
        # What is known of every value the step reads or makes, before running frees some.
        self.info = {v: (values[v].meta, values[v].location, values[v].storage)
                     for n in self.nodes for v in (*n.inputs(), *n.outputs)}  # fmt: skip
        self.start = start
        self.start_vid = {id(cell): vid for vid, cell in start.items()}
        self.arg_of = arg_of
        self.args = [snapshot(a) for a in flat]
        # The pointer each pointer argument was: one passed on two recordings in a row may
        # also be read by `fn` otherwise (a closure), so a replay takes only that pointer.
        self.arg_cells = {i: a._cell for i, a in enumerate(flat) if isinstance(a, RemoteTensor)}
        self.params = run_params(self.nodes)
        self.param_snaps = [snapshot(p) for p in self.params]
        # The user's own tensor behind each local tensor parameter (None for a float).
        self.param_sources = [s for n in self.nodes for s in param_sources(n)]
        self.param_where = [(n.name, n.meta.get("where", "<unknown>"))
                            for n in self.nodes for _ in n.params]  # fmt: skip
        self.watched: tuple[list, list] = ([], [])
        self.hyper: list = []  # (optimizer, group, key) of each float or tensor hyperparameter
        self.state: tuple = ()
        self.referents: list[weakref.ref] = []  # what `state` names by id, weakly

    def take_hyperparameters(self, at_step: list) -> None:
        """Note the optimizers' floats and local tensors (`lr`) as arguments after the
        call's own: their values when the step ran (`at_step`)."""
        self.hyper = hyperparameters(self.watched[1])
        now = [snapshot(v) for v in hyperparameter_values(self.hyper)]
        if len(now) != len(at_step) or not all(map(same, now, at_step)):
            self._not(
                "the step changes an optimizer's hyperparameter (lr, ...) itself, and a "
                "replay runs no Python: step the LR scheduler outside the compiled function"
            )
        self.args += at_step

    def arguments(self, flat: list) -> list:
        """The call's arguments, then the optimizers' hyperparameters now."""
        return flat + hyperparameter_values(self.hyper)

    def _not(self, reason: str) -> None:
        self.reason = self.reason or reason

    def source(self, vid: int) -> Source | None:
        if vid in self.arg_of:
            return self.arg_of[vid]
        return self.start.get(vid)

    def note_effects(self, result: Any) -> None:
        """Which pointers the call rebound, attached (`.grad`) and returned, by value id."""
        client, values = self.client, self.client.graph.values
        new_cells = {id(cell): cell for cell in client.live.values()
                     if id(cell) not in self.start_vid}  # fmt: skip
        accounted: set[int] = set()
        self.rebinds: list[tuple[Source, int, TensorMeta | None]] = []
        self.grads: list[tuple[Source, int]] = []
        grads_changed = False  # whether a backward pass inside the step reached a leaf
        for vid0, cell in self.start.items():
            if cell.vid != vid0 and cell.vid is not None:
                if cell.vid not in self.produced:
                    self._not(f"a pointer now names %{cell.vid}, which the step did not make")
                    continue
                meta = values[cell.vid].meta
                reshaped = meta if meta != self.info.get(vid0, (meta,))[0] else None
                self.rebinds.append((self.source(vid0), cell.vid, reshaped))
            p = cell.ref() if cell.ref is not None else None
            if p is not None and p.is_leaf and p.requires_grad:
                g = p.grad
                if isinstance(g, RemoteTensor) and id(g._cell) in new_cells:
                    self.grads.append((self.source(vid0), g._vid))
                    accounted.add(id(g._cell))
                    grads_changed = True
                elif isinstance(g, RemoteTensor) and g._vid != self.start_vid.get(id(g._cell)):
                    grads_changed = True  # accumulated into
        self.new_returns: list[int] = []
        self.attached = False  # whether a returned pointer requires grad
        self.returns = self._template(result, new_cells, accounted)
        if self.attached and not grads_changed:
            self._not(
                "the step returns a tensor that requires grad and runs no backward pass: a "
                "replay's results are detached, so a backward through them would miss the "
                "step's parameters. Call it under torch.no_grad(), return .detach(), or run "
                "the backward inside the step"
            )
        for key in new_cells:
            if key not in accounted:
                self._not(
                    "the step leaves new pointers that it neither returns nor sets as a .grad "
                    "(state created on a first step, or pointers kept in Python objects)"
                )
        for _, vid, _ in self.rebinds:
            if vid not in self.produced:
                self._not("a pointer names a value the step did not make")

    def _template(self, obj: Any, new_cells: dict, accounted: set[int]) -> Any:
        if isinstance(obj, RemoteTensor):
            cell = getattr(obj, "_cell", None)
            if obj._owner is not self.client or cell is None:
                self._not("the step returns a pointer of another grid")
            elif id(cell) in new_cells and obj._vid in self.produced:
                accounted.add(id(cell))
                self.attached = self.attached or obj.requires_grad
                self.new_returns.append(obj._vid)
                return ("new", len(self.new_returns) - 1)
            elif id(cell) in self.start_vid:
                return ("old", self.source(self.start_vid[id(cell)]))
            else:
                self._not("the step returns a pointer it did not make")
            return None
        if isinstance(obj, torch.Tensor):
            self._not("the step returns a local tensor")
            return None
        if isinstance(obj, (tuple, list)):
            return (type(obj), tuple(self._template(x, new_cells, accounted) for x in obj))
        if isinstance(obj, dict):
            items = tuple((k, self._template(v, new_cells, accounted)) for k, v in obj.items())
            return (dict, items)
        if obj is None or type(obj) in (bool, int, float, str):
            return ("value", obj)
        self._not(f"the step returns a {type(obj).__name__}")
        return None

    def run(self) -> None:
        """Run the whole step as one plan; note its slots, and what each slot becomes."""
        client = self.client
        fetch = [v for v in self.new_returns if self.info[v][0].nbytes <= PREFETCH_BYTES]
        plan, slots, replies = client.run_pending(fetch)
        self.plan: Plan = plan
        for reply in replies.values():
            for slot, tensor in reply.get("returns", ()):
                client.prefetched[slots[slot]] = tensor
        values = client.graph.values
        slot_of = {v: s for s, v in enumerate(slots)}
        self.n_slots = len(slots)
        worker_of = {v: w for n, w in zip(self.nodes, plan.node_workers) for v in n.outputs}
        first_with: dict[int, int] = {}  # storage -> first slot on it
        # (slot, source, (meta, location, first slot on its storage, autograd state)) of each
        # external input.
        self.inputs: list[tuple[int, Source, tuple]] = []
        # (slot, meta, first slot on its storage, worker) of each value the step makes.
        self.outputs: list[tuple[int, TensorMeta, int, str]] = []
        self.where: dict[int, str] = {}
        # (op, meta) of the node that made each kept value: errors name a replay's values
        # as the recording's (`weight.grad`, `relu@train.py:12`).
        self.origins = {slot_of[v]: (n.op, n.meta) for v, n in self.produced.items()
                        if v in values and v in slot_of}  # fmt: skip
        for s, vid in enumerate(slots):
            meta, location, storage = self.info[vid]
            first = first_with.setdefault(storage, s)
            if vid in self.produced:
                self.outputs.append((s, meta, first, worker_of[vid]))
                self.where[s] = self.produced[vid].meta.get("where", "<unknown>")
            else:
                source = self.source(vid)
                if source is None:
                    self._not(f"the step reads %{vid}, which no pointer names")
                cell = self.arg_cells.get(source) if type(source) is int else source
                grad = autograd_state(cell.ref() if cell is not None else None)
                self.inputs.append((s, source, (meta, location, first, grad)))
        self.kept = frozenset(s for s, v in enumerate(slots) if v in values)
        self.rebinds = [(src, slot_of[v], m) for src, v, m in self.rebinds if v in slot_of]
        self.grads = [(src, slot_of[v]) for src, v in self.grads if v in slot_of]
        self.new_returns = [slot_of.get(v, -1) for v in self.new_returns]
        self.prefetch = [slot_of[v] for v in fetch]
        self.effects = (tuple(self.rebinds), tuple(self.grads), self.returns,
                        tuple(self.new_returns), tuple(self.prefetch))  # fmt: skip
        if -1 in self.new_returns:
            self._not("the step returns a value its run did not make")
        # Keep no Node objects, nor the cells of every pointer of the start.
        self.nodes = self.produced = self.info = self.start = self.start_vid = None


def _differs(a: _Recording, b: _Recording) -> str | None:
    """What keeps two recordings from making a replay (None: they ran the same plan with
    the same effects)."""
    if a.reason is not None or b.reason is not None:
        return b.reason or a.reason
    if a.client is not b.client:
        return "the two calls ran on different grids"
    if a.plan.id != b.plan.id or a.kept != b.kept:
        return "the two calls ran different plans (other ops, shapes, workers or aliasing)"
    if [(s, src) for s, src, _ in a.inputs] != [(s, src) for s, src, _ in b.inputs]:
        return "the two calls read different pointers"
    if a.effects != b.effects:
        return "the two calls left different pointers (a first step creates state)"
    if [list(map(id, w)) for w in a.watched] != [list(map(id, w)) for w in b.watched]:
        return "the two calls used different modules or optimizers"
    if a.state != b.state or not alive(a.referents):
        return "a module's or optimizer's settings, parameters or hooks changed between them"
    if [type(p) for p in a.params] != [type(p) for p in b.params]:
        return "the floats and local tensors the ops take differ in kind"
    return None


def _guard_change(old: tuple, new: tuple, describe: Callable[[int], str]) -> str:
    """Which guard made a call new (the keys `Compiled._call` builds)."""
    if old[:2] != new[:2] or len(old) != len(new):
        return "the call passed other arguments (number, keywords or containers)"
    n_flat = len(new) - 2 - 1 - len(modes())
    for i in range(n_flat):
        if old[2 + i] != new[2 + i]:
            return f"{describe(i)} changed its guard: {_show_guard(old[2 + i])} -> " + (
                _show_guard(new[2 + i])
            )
    if old[2 + n_flat] != new[2 + n_flat]:
        return "pointer arguments alias each other differently"
    return "torch's grad mode, autocast or default dtype changed"


def _show_guard(g: Any) -> str:
    if isinstance(g, tuple) and len(g) >= 2 and isinstance(g[1], TensorMeta):
        meta = g[1]
        return f"{tuple(meta.shape)} {meta.dtype}"
    if isinstance(g, tuple) and len(g) >= 4 and isinstance(g[2], TensorMeta):
        return f"pointer {tuple(g[2].shape)} {g[2].dtype} on {g[3]}"
    if isinstance(g, tuple) and len(g) == 2:
        return repr(g[1])
    return getattr(g, "__name__", repr(g))


class _Replay:
    """A recorded step ready to run again with new arguments and the pointers' new values."""

    def __init__(
        self, previous: _Recording, rec: _Recording, name: str, describe: Callable
    ) -> None:
        self.rec = rec
        self.describe = lambda i: describe(i, rec.hyper)  # an argument, for messages
        self.params = list(rec.params)
        # Parameters taken from the call's arguments (and optimizers' hyperparameters):
        # (param index, argument index, how: "as is", "scalar" or "negated").
        self.from_args: list[tuple[int, int, str]] = []
        changed = {i for i, (a, b) in enumerate(zip(previous.args, rec.args))
                   if a is not None and not same(a, b)}  # fmt: skip
        used: set[int] = set()
        for k, (before, now) in enumerate(zip(previous.param_snaps, rec.param_snaps)):
            src, how = next(
                ((i, how) for i in sorted(changed)
                 for how in [_taken_as(previous.args[i], rec.args[i], before, now)] if how),
                (None, None),
            )  # fmt: skip
            if src is not None and how is not None:
                self.from_args.append((k, src, how))
                used.add(src)
            elif not same(before, now):
                op, where = rec.param_where[k]
                raise GridError(
                    f"gg.compile({name}): {op} recorded at {where} takes {show(now)}, which "
                    f"was {show(before)} on the previous call and is not an argument of "
                    f"{name}: a replay would reuse a stale value. Pass the value the op takes "
                    "as an argument (for example a learning rate or a scale), or keep it "
                    "constant. torch.optim.Adam computes its bias correction from a step "
                    "counter in Python: it cannot be replayed; SGD (with momentum) can."
                )

        # A changed argument equal to a taken one in both recordings (two param groups' lr
        # on one schedule): the ops that read it took the other; it must stay equal to it.
        def equal(i: int, j: int) -> bool:
            return same(previous.args[i], previous.args[j]) and same(rec.args[i], rec.args[j])

        self.tied = [(j, i) for j in sorted(changed - used)
                     for i in [next((i for i in sorted(used) if equal(i, j)), None)]
                     if i is not None]  # fmt: skip
        # Float and tensor arguments the ops do not take as they are: frozen.
        tied = {j for j, _ in self.tied}
        self.fixed = [(i, rec.args[i]) for i, a in enumerate(rec.args)
                      if a is not None and i not in used and i not in tied]  # fmt: skip
        # Constant local tensors that are one tensor of the user's in both recordings (a
        # closure's): sent as they are at each call, as torch would read them then.
        taken = {k for k, _, _ in self.from_args}  # (a closure's tensor, below)
        self.sources = [(k, src, TensorMeta.of(as_sent(src)))
                        for k, (src, before) in enumerate(zip(rec.param_sources,
                                                              previous.param_sources))
                        if k not in taken and src is not None and src is before]  # fmt: skip
        self.same_pointers = [(i, cell) for i, cell in rec.arg_cells.items()
                              if previous.arg_cells.get(i) is cell]  # fmt: skip

    def mismatch(self, flat: list) -> str | None:
        """The checks that need no lock (grid open, Python state, frozen arguments): what
        differs from the recordings, or None when the call may replay."""
        rec = self.rec
        if rec.client.closed:
            raise GridError("this grid is closed")
        for i, cell in self.same_pointers:
            if flat[i]._cell is not cell:
                return f"{self.describe(i)} is another pointer than in the recordings"
        for i, snap in self.fixed:
            if not same(snap, snapshot(flat[i])):
                return (
                    f"{self.describe(i)} is {show(snapshot(flat[i]))}, was {show(snap)}; it "
                    "was the same in the two recordings, so the replay took it as a constant"
                )
        for j, i in self.tied:
            if not same(snapshot(flat[j]), snapshot(flat[i])):
                return (
                    f"{self.describe(j)} is {show(snapshot(flat[j]))} and {self.describe(i)} "
                    f"{show(snapshot(flat[i]))}: they were equal in the two recordings, so the "
                    "replay read one for both"
                )
        for _, src, meta in self.sources:
            if TensorMeta.of(as_sent(src)) != meta:
                return "a local tensor the step reads changed shape or dtype"
        if not alive(rec.referents):
            return "a module's or optimizer's parameter was replaced"
        if state(rec.watched) != rec.state:
            return "a module's settings, parameters or hooks, or an optimizer's, changed"
        return None

    def run(self, flat: list) -> Any:
        """Replay the step, or `_MISS` when its external inputs are not as recorded."""
        rec, client = self.rec, self.rec.client
        with client.exclusive():
            client.release_dead()
            if not set(rec.plan.programs) <= set(lost.usable(client)):
                return _MISS  # a worker it runs on was lost: record it anew, placed without
            if client.graph.pending:
                client.compute_all()
            client.prefetched.clear()
            values, live, failed = client.graph.values, client.live, client.failed
            slots = [0] * rec.n_slots
            storage_at: dict[int, int] = {}
            first_on: dict[int, int] = {}  # storage -> first slot on it
            for s, src, (meta, location, first, grad) in rec.inputs:
                cell = flat[src]._cell if type(src) is int else src
                vid = cell.vid
                value = values.get(vid)
                if (
                    live.get(vid) is not cell
                    or value is None
                    or value.meta != meta
                    or value.location != location
                    or first_on.setdefault(value.storage, s) != first
                    or autograd_state(cell.ref()) != grad
                ):
                    return _MISS
                if vid in failed:
                    raise failed[vid]
                slots[s] = vid
                storage_at[s] = value.storage
            new_id = client.graph.new_id
            for s, _, first, _ in rec.outputs:
                vid = slots[s] = new_id()
                storage_at[s] = vid if first == s else storage_at[first]
            params = list(self.params)
            for k, i, how in self.from_args:
                a = flat[i]
                if how == "as is":
                    params[k] = as_sent(a) if isinstance(a, torch.Tensor) else a
                else:  # the number a float or one-element tensor holds, maybe negated
                    number = float(a) if type(a) is float else scalar(snapshot(a))
                    params[k] = -number if how == "negated" else number
            for k, src, _ in self.sources:
                params[k] = as_sent(src)
            outputs = [slots[s] for s, _, _, _ in rec.outputs if s in rec.kept]
            frees_on_error = [(location, slots[s]) for s, _, (_, location, _, _) in rec.inputs
                              if s not in rec.kept and location is not None]  # fmt: skip
            lost.check(client, rec.plan)  # (a worker found lost: nothing sent, nothing ran)
            try:  # (returns once sent: its small results come back with its replies)
                client.replay(rec.plan, slots, params, rec.where, outputs, frees_on_error)
            except (RemoteError, WorkerLost) as e:
                self._settle(flat, slots, storage_at, e)
                raise
            return self._settle(flat, slots, storage_at, None)

    def _settle(self, flat: list, slots: list[int], storage_at: dict, error: Exception | None):
        """Leave the client as the recorded call did: values known, pointers rebound and
        attached. After a failed run the step's values are failed ones, as a traced step's."""
        rec, client = self.rec, self.rec.client
        graph, live = client.graph, client.live
        for s, meta, _, worker in rec.outputs:
            if s in rec.kept:
                vid = slots[s]
                graph.add_value(meta, storage=storage_at[s], vid=vid,
                                location=None if error else worker)  # fmt: skip
                graph.values[vid].origin = rec.origins.get(s)
                if error is not None:
                    client.failed[vid] = error
        for s, _, (_, location, _, _) in rec.inputs:
            if s not in rec.kept:
                graph.values.pop(slots[s], None)
                if error is not None and location is not None:
                    client.free_later(location, slots[s])
        for src, s, reshaped in rec.rebinds:
            cell = flat[src]._cell if type(src) is int else src
            if live.get(cell.vid) is cell:
                del live[cell.vid]
            cell.vid = slots[s]
            live[cell.vid] = cell
            p = cell.ref()
            if p is not None:
                p._vid = cell.vid
                if reshaped is not None:
                    p._set_meta(reshaped)
        made: dict[int, RemoteTensor] = {}
        for src, s in rec.grads:
            leaf = flat[src] if type(src) is int else src.ref()
            made[s] = client.make_pointer(slots[s])
            if leaf is not None:
                leaf.grad = made[s]
        if error is not None:
            return None
        for s in rec.new_returns:
            if s not in made:  # a pointer returned twice is one pointer
                made[s] = client.make_pointer(slots[s])
        return _build(rec.returns, [made[s] for s in rec.new_returns], flat)


def _taken_as(arg_before: Any, arg_now: Any, before: Any, now: Any) -> str | None:
    """How an op took an argument in two recordings: "as is" (the float or tensor), as
    the number it holds ("scalar": a tensor `lr`), or "negated" (SGD's `alpha=-lr`); None
    if it did not take it."""
    if same(arg_now, now) and same(arg_before, before):
        return "as is"
    if type(now) is not float or type(before) is not float:
        return None
    a_now, a_before = scalar(arg_now), scalar(arg_before)
    if a_now is None or a_before is None:
        return None
    if same(a_now, now) and same(a_before, before):
        return "scalar"
    if same(-a_now, now) and same(-a_before, before):
        return "negated"
    return None


def _build(template: Any, news: list[RemoteTensor], flat: list) -> Any:
    kind, body = template
    if kind == "new":
        return news[body]
    if kind == "old":
        return flat[body] if type(body) is int else body.ref()
    if kind == "value":
        return body
    if kind is dict:
        return {k: _build(v, news, flat) for k, v in body}
    return kind(_build(x, news, flat) for x in body)
