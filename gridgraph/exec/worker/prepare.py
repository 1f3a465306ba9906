"""A program as a worker prepares it: checked, its calls resolved, its footprint worked out.

Running a program: every step is checked when the program arrives (`Program`), and each call
step is prepared then, once (`CompiledCall`: its op resolved from the allowlist, its arguments
a template with the slot and parameter positions to fill), so a replay of a cached program
looks up no names and dispatches on no argument types; before a run,
the shapes of everything it creates are worked out on the meta device from the stored inputs
(`Program.footprint`), with a bound on the scratch memory each op takes while it runs
(`limits.op_scratch`), so a run that would break the memory or time limit is refused before
any step runs (a run's slots name distinct values, and inputs that are one tensor object
share one meta tensor, so what the walk sees is what the run will hold). Steps whose inputs
only arrive during the run (a `recv`) are checked just before they run, each from a walk of
the same kind over the steps up to the next recv, made once the recv has stored what it
received (`Stretch`); walks are remembered per layout of what they read (a replayed step
receives the same layouts every time). An op whose output size its data sets (bincount,
nonzero), and the ops that read what it made, are checked just before they run, from a
bound read off its arguments (`limits.data_dependent_footprint`), or from a meta run on
theirs (`CompiledCall.footprint`). A call whose meta kernel refuses its arguments fails
with that kernel's error when it is reached: its real kernel never runs (CPU kernels have
taken what their meta kernels refuse, and read past memory). Every result is
bounds-checked, the memory limit is checked after every call (from running byte counts) and
the time limit before every step. A run that fails undoes what it stored. The work the
footprint finds for a call also sets how many intra-op threads it runs on (intraop.py).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from gridgraph.exec import resend
from gridgraph.exec.safety.limits import (
    meta_like,
    op_footprint,
)
from gridgraph.exec.worker import intraop
from gridgraph.exec.worker.ops import (
    resizes,
    runner,
)
from gridgraph.exec.worker.session import RequestError
from gridgraph.exec.worker.store import ObjectStore
from gridgraph.schedule.program import (
    Call,
    Free,
    MalformedStep,
    Param,
    Recv,
    Return,
    Send,
    Slot,
    Step,
    parse_program,
)
from gridgraph.trace.allowlist import resolve

CALL_STEP_BYTES = 1024  # a prepared call step (CompiledCall), about; see held_bytes
FOOTPRINTS_KEPT = 8  # per program and per call step: footprints remembered, by layouts


class Program:
    """A checked program: every step well-formed, every slot and parameter in range.

    `stages` is the program as it came, in list form; its steps are read once, here
    (program.parse_program), into the step classes everything after reads."""

    def __init__(self, stages: Any, n_slots: int, nbytes: int) -> None:
        try:
            self.steps, self.params = parse_program(stages, n_slots)
        except MalformedStep as e:
            raise RequestError(str(e)) from e
        self.n_slots = n_slots
        # The workers it sends to or receives from: a run names each one's identity.
        self.workers = {s.worker for s in self.steps if type(s) is Send or type(s) is Recv}
        # Each call step prepared once (its op resolved, its arguments turned into
        # accessors), so a run does no name lookup and no per-argument type dispatch.
        self.calls: dict[int, CompiledCall] = {
            i: CompiledCall(step) for i, step in enumerate(self.steps) if type(step) is Call
        }
        # What keeping it costs its session, roughly: its decoded steps, not the bytes it
        # came in (an empty list is 1 byte on the wire and 64 in memory).
        raw = [step for stage in stages for step in stage]
        self.nbytes = max(nbytes, held_bytes(raw) + CALL_STEP_BYTES * len(self.calls))
        # Walked on meta before a run: all its steps. After each recv: the steps up to the
        # next recv (each step in one such stretch, so what they remember stays in
        # proportion to the program).
        self.whole = Stretch(self.steps, self.calls, 0, len(self.steps))
        recvs = [i for i, step in enumerate(self.steps) if type(step) is Recv]
        # How long each recv step waited in earlier runs, by step index (exec/resend.py).
        self.recv_times = resend.AnswerTimes()
        self.after_recv = {
            i: Stretch(self.steps, self.calls, i + 1, stop)
            for i, stop in zip(recvs, [*recvs[1:], len(self.steps)])
        }

    def footprint(self, store: ObjectStore, slots: list[int], params: dict) -> tuple:
        """(new bytes at the peak, work, {call step: (its new bytes and scratch, its work)})
        of all its steps, before a run (`Stretch.footprint`)."""
        return self.whole.footprint(store, slots, params)


class Stretch:
    """Steps of a program walked together on meta tensors (`_footprint`), from the stored
    values they read before they define them (`inputs`) and the run's parameters.

    A program's footprint is worked out over all its steps before it runs; the steps after
    a recv read what it received, so those up to the next recv are worked out again when it
    has stored that, and each of their calls is checked just before it runs (`Run.call`).
    A footprint is remembered per metadata of the inputs and parameters (FOOTPRINTS_KEPT):
    a replayed step receives the same layouts every time, and a meta run of each op costs
    more than most small ops do.
    """

    def __init__(
        self, steps: list[Step], calls: dict[int, CompiledCall], start: int, stop: int
    ) -> None:
        self.steps, self.calls, self.start, self.stop = steps, calls, start, stop
        defined: set[int] = set()
        self.inputs: list[int] = []  # slots read before these steps define them
        for step in steps[start:stop]:
            for slot in step.reads():
                if slot not in defined and slot not in self.inputs:
                    self.inputs.append(slot)
            defined.update(step.defines())
        # (input metas, params) -> (bytes at peak, work, {call step: (bytes, work)})
        self._footprints: OrderedDict[tuple, tuple] = OrderedDict()

    def footprint(self, store: ObjectStore, slots: list[int], params: dict) -> tuple:
        """(new bytes at the peak, work, {call step index: (new bytes and scratch, work)}).

        A call step missing from the dict depends on a transfer or on data: it is checked
        when it runs (`Run.check_footprint`)."""
        inputs = {s: store.get(slots[s]) for s in self.inputs if store.has(slots[s])}
        first: dict[int, int] = {}  # an input's tensor object -> the first input slot holding it
        key = (
            tuple((s, _meta_key(t)) for s, t in inputs.items()),
            tuple(first.setdefault(id(t), s) for s, t in inputs.items()),  # (see _footprint)
            tuple(sorted((i, _param_key(p)) for i, p in params.items())),
        )
        return _remembered(self._footprints, key, lambda: _footprint(self, inputs, params))


class CompiledCall:
    """A checked call step prepared to run: its op resolved from the allowlist, its
    arguments a template whose slot and parameter positions are filled per run.

    Nothing here is generated source: the op comes from `resolve` (the allowlist), and the
    slot and parameter indices filled in, which `parse_step` checked to be in range, are
    data (`slot_args`) or closed over (`fills`).
    """

    __slots__ = ("name", "op", "run", "resizes", "args", "kwargs", "slot_args", "fills",
                 "filled", "outs", "writes", "report", "n_returns", "one_out",
                 "threads_matter_from", "_footprints")  # fmt: skip

    def __init__(self, step: Call) -> None:
        name, args, kwargs = step.op, step.args, step.kwargs
        outs, writes, report = step.outs, step.writes, step.report
        self.name = name
        self.op = resolve(name)
        self.run = runner(self.op)  # (session rng, args, kwargs) -> result; see ops.py
        self.resizes = resizes(self.op)  # it may grow its first argument's storage in place
        self.threads_matter_from = intraop.threads_matter_from(self.op)
        self.outs, self.writes, self.report = outs, writes, report
        self.n_returns = len(outs) - len(writes)
        # Its result, when a tensor, goes to one slot and nothing else changes (most calls):
        # a run stores it without the general path's unpacking (`Run.call`).
        self.one_out = len(outs) == 1 and not writes and not report and not self.resizes
        # The arguments that name a slot or parameter are filled in per run: (position,
        # slot) for a positional slot (most of them: filled in a loop, with no call each),
        # (position or keyword, filler) for the rest; the other arguments are constants,
        # shared with the template (see `_filler`).
        self.args = list(args)
        self.kwargs = dict(kwargs)
        self.slot_args = [(i, a.index) for i, a in enumerate(args) if type(a) is Slot]
        self.fills = [
            (i, _filler(a)) for i, a in enumerate(args) if type(a) is not Slot and _has_ref(a)
        ]
        self.fills += [(k, _filler(a)) for k, a in kwargs.items() if _has_ref(a)]
        self.filled = [i for i, _ in self.slot_args] + [where for where, _ in self.fills]
        # metadata of the arguments -> (new bytes, work) or None: see `footprint`
        self._footprints: OrderedDict[tuple, tuple[int, float] | None] = OrderedDict()

    def footprint(self, args: list, kwargs: dict) -> tuple[int, float] | None:
        """(bytes of new storage and scratch, work) of this call on these arguments, from a
        run on meta tensors (limits.op_footprint); None when meta cannot tell (data-dependent
        ops). Raises what its meta kernel raised when that refuses the arguments.

        Remembered per argument metadata (the FOOTPRINTS_KEPT last used), since a replayed
        step's steps that read transferred tensors see the same metadata every time and a
        meta run costs more than most small ops do."""
        try:  # (the constant arguments are the same every run: the filled ones tell)
            key = tuple([_meta_key(args[w] if type(w) is int else kwargs[w]) for w in self.filled])
            hash(key)
        except TypeError:  # an argument that does not hash: work it out every time
            return self._meta_footprint(args, kwargs)
        return _remembered(self._footprints, key, lambda: self._meta_footprint(args, kwargs))

    def _meta_footprint(self, args: list, kwargs: dict) -> tuple[int, float] | None:
        meta_args = [_to_meta(a) for a in args]
        meta_kw = {k: _to_meta(v) for k, v in kwargs.items()}
        result = op_footprint(self.op, meta_args, meta_kw)
        return None if result is None else _charged(result)

    def arguments(self, get: Any, slots: list[int], params: dict) -> tuple[list, dict]:
        """This call's (args, kwargs) for one run: `get(slots[slot])` gives a slot's tensor."""
        args, kwargs = self.args.copy(), self.kwargs.copy()
        for i, slot in self.slot_args:
            args[i] = get(slots[slot])
        for where, fill in self.fills:
            if type(where) is int:
                args[where] = fill(get, slots, params)
            else:
                kwargs[where] = fill(get, slots, params)
        return args, kwargs


def held_bytes(value: Any) -> int:
    """Bytes a decoded message value holds, roughly: each container its own size and a
    pointer per element, each string its length. (A program adds CALL_STEP_BYTES for each
    prepared call step: its fillers and template.)"""
    total, stack = 0, [value]
    while stack:
        v = stack.pop()
        t = type(v)
        if t is list or t is dict:
            total += 64 + 8 * len(v)
            stack.extend(v.values() if t is dict else v)
        elif t is str or t is bytes:
            total += 49 + len(v)
        else:
            total += 32
    return total


def _charged(footprint: tuple) -> tuple[int, float]:
    """(new bytes and scratch, work) of an op's `limits.op_footprint`: what it is checked by."""
    _, made, scratch, work = footprint
    return sum(made.values()) + scratch, work


def _remembered(cache: OrderedDict, key: Any, work_out: Callable[[], Any]) -> Any:
    """`cache[key]`, from `work_out()` when missing; the FOOTPRINTS_KEPT entries last used
    stay (a program whose steps see a few layouts in turn keeps each of them)."""
    if key in cache:
        cache.move_to_end(key)
        return cache[key]
    value = cache[key] = work_out()
    if len(cache) > FOOTPRINTS_KEPT:
        cache.popitem(last=False)
    return value


def _has_ref(a: Any) -> bool:
    t = type(a)
    if t is Slot or t is Param:
        return True
    return t is list and any(_has_ref(x) for x in a)


def _filler(a: Any) -> Any:
    """A function (get, slots, params) -> the argument `a` names in one run (see
    `CompiledCall.arguments`)."""
    t = type(a)
    if t is Slot:
        index = a.index
        return lambda get, slots, params: get(slots[index])
    if t is Param:
        index = a.index
        return lambda get, slots, params: params[index]
    if t is list:
        parts = [_filler(x) for x in a]
        return lambda get, slots, params: [part(get, slots, params) for part in parts]
    # A constant, shared by every run: ATen copies the lists and numbers it is given and
    # never changes or keeps the Python objects.
    return lambda get, slots, params: a


def _param_key(p: Any) -> Any:
    """What of parameter `p` a footprint depends on: a tensor's layout (also in a list: a
    long tensor's repr is summarised, so two of different shapes can print alike)."""
    if isinstance(p, torch.Tensor):
        return ("tensor", p.shape, p.stride(), p.dtype)
    if isinstance(p, list):
        return ("list", *[_param_key(x) for x in p])
    return repr(p)


def _footprint(stretch: Stretch, inputs: dict[int, torch.Tensor], params: dict) -> tuple:
    """Run `stretch`'s steps on meta tensors: the peak of new bytes, the work, and each known
    call's new bytes (with its scratch) and work."""
    # Inputs that are one tensor object (an in-place op's result is stored under its own
    # value id and its input's) get one meta tensor: a layout change through one (as_strided_)
    # shows through the other, as it will when the program runs.
    same: dict[int, torch.Tensor] = {}  # id of an input's tensor object -> its meta tensor
    metas = {}
    for s, t in inputs.items():
        if id(t) not in same:
            same[id(t)] = meta_like(t)
        metas[s] = same[id(t)]
    meta_params = {i: _to_meta(p) for i, p in params.items()}  # (tensors in a list too)
    new_bytes: dict[int, int] = {}  # meta storage -> bytes, for storages this program makes
    users: dict[int, int] = {}  # meta storage -> slots naming it
    now = peak = 0
    work = 0.0
    ops: dict[int, tuple[int, float]] = {}

    def bind(slot: int, t: torch.Tensor | None) -> None:
        nonlocal now
        old = metas.pop(slot, None)
        if old is not None:
            key = old.untyped_storage()._cdata
            users[key] -= 1
            if users[key] == 0 and key in new_bytes:
                now -= new_bytes.pop(key)
        if t is not None:
            metas[slot] = t
            key = t.untyped_storage()._cdata
            users[key] = users.get(key, 0) + 1

    for t in metas.values():
        key = t.untyped_storage()._cdata
        users[key] = users.get(key, 0) + 1
    steps = stretch.steps
    for i in range(stretch.start, stretch.stop):
        step = steps[i]
        kind = type(step)
        if kind is Call:
            args, kwargs, outs, writes = step.args, step.kwargs, step.outs, step.writes
            known = all(type(r) is Param or r.index in metas for r in step.refs())
            footprint = None
            if known:
                resolved = [_meta_arg(a, metas, meta_params) for a in args]
                kw = {k: _meta_arg(v, metas, meta_params) for k, v in kwargs.items()}
                try:
                    footprint = op_footprint(stretch.calls[i].op, resolved, kw)
                except Exception:  # its meta kernel refused it: so is it, when it runs
                    footprint = None  # (`Run.check_footprint`), after the steps before it
            if footprint is None:  # depends on a transfer or on data: check when it runs
                for slot in [*outs, *(s for _, s in writes)]:
                    bind(slot, None)
                continue
            result, made, scratch, _ = footprint
            ops[i] = _charged(footprint)
            work += ops[i][1]
            for key, nbytes in made.items():
                if not users.get(key):  # (growth of a storage held already, by resize_, stays
                    new_bytes[key] = nbytes  # counted: values outside the run may hold it)
            now += sum(made.values())
            peak = max(peak, now + scratch)  # (scratch: freed by the time the op returns)
            tensors = _result_tensors(result)
            for slot, t in zip(outs, tensors):
                bind(slot, t)
            for path, slot in writes:
                t = at_path(resolved, kw, path)
                bind(slot, t if isinstance(t, torch.Tensor) else None)
        elif kind is Recv:
            for slot in step.slots:
                bind(slot, None)  # counted when it arrives, against the inbox
        elif kind is Free:
            bind(step.slot, None)
        elif kind is Return and step.slot in metas:  # the reply holds a copy
            t = metas[step.slot]
            now += t.numel() * t.element_size()
            peak = max(peak, now)
    return peak, work, ops


def _meta_arg(a: Any, metas: dict, params: dict) -> Any:
    t = type(a)
    if t is Slot:
        return metas[a.index]
    if t is Param:
        return params[a.index]
    if t is list:
        return [_meta_arg(x, metas, params) for x in a]
    return a


def _result_tensors(result: Any) -> list[torch.Tensor]:
    if isinstance(result, torch.Tensor):
        return [result]
    if isinstance(result, (tuple, list)):
        return [r for r in result if isinstance(r, torch.Tensor)]
    return []


def _meta_key(a: Any) -> Any:
    """What of argument `a` an op's footprint depends on: a tensor's layout, not its data."""
    if isinstance(a, torch.Tensor):
        storage = a.untyped_storage().nbytes()
        return (a.dtype, a.shape, a.stride(), a.storage_offset(), storage)
    if type(a) is list or type(a) is tuple:
        return tuple([_meta_key(x) for x in a])
    return (type(a), a)


def _to_meta(a: Any) -> Any:
    if isinstance(a, torch.Tensor):
        return meta_like(a)
    if isinstance(a, list):
        return [_to_meta(x) for x in a]
    return a


def at_path(args: list, kwargs: dict, path: Any) -> Any:
    if isinstance(path, list):  # (argument, index in a tensor list)
        return at_path(args, kwargs, path[0])[path[1]]
    return args[path] if type(path) is int else kwargs[path]
