"""The program format: the steps a worker runs, in one definition.

A worker's program is a list of stages, each a list of steps (plan.py says how a plan makes
them and in what order):

    Call(op, args, kwargs, outs, writes, report)   run an ATen op on values the worker holds
    Send(slots, worker) / Recv(slots, worker)      push values to another worker / wait for them
    Free(slot) / Return(slot)                      drop a value / send it back with the reply

Steps name values by slot (`Slot(k)`, an index into the plan's slots) and per-run values by
parameter (`Param(k)`); each says which slots it reads, which it defines and which
parameters it uses. On the wire (msgpack, exec/wire.py) a step is a list, its kind first
(`["call", op, args, kwargs, outs, writes, report]`, `["send", [slot, ...], worker]`,
`["free", slot]`, ...). `to_wire` writes a program so; `parse_program` reads one back and
refuses (`MalformedStep`, or `OpRefused` for an op off the allowlist) any step that is not
well-formed or names a slot beyond the program's values, before any step of it runs: a
worker takes programs from whoever sends them. plan.split and the client's storage moves
build steps from these classes; nothing reads a step by position.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from gridgraph.trace.allowlist import resolve


@dataclass(frozen=True, slots=True)
class Slot:
    """A value in a program, by its index in `Plan.slots`."""

    index: int


@dataclass(frozen=True, slots=True)
class Param:
    """A per-run parameter (a Python float or a local tensor), by index in `Plan.params`."""

    index: int


class MalformedStep(ValueError):
    """A program received in wire form that is not well-formed: refused before it runs."""


@dataclass(slots=True)
class Call:
    """Run `op` on `args` and `kwargs` (with slots and parameters in them); its results go
    to `outs`, and the arguments it writes in place (`writes`: (argument path, slot) pairs)
    to their slots; `report`: the worker reports its results' metadata (data-dependent ops).
    """

    kind: ClassVar[str] = "call"
    op: str
    args: list
    kwargs: dict
    outs: list[int]
    writes: list
    report: bool

    def refs(self) -> list[Slot | Param]:
        """The slots and parameters its arguments name, in argument order."""
        found: list[Slot | Param] = []
        _refs_in(self.args, found)
        _refs_in(list(self.kwargs.values()), found)
        return found

    def reads(self) -> list[int]:
        return [r.index for r in self.refs() if type(r) is Slot]

    def defines(self) -> list[int]:
        return [*self.outs, *(slot for _, slot in self.writes)]

    def params(self) -> list[int]:
        return [r.index for r in self.refs() if type(r) is Param]

    def wire(self) -> list:
        return ["call", self.op, self.args, self.kwargs, self.outs, self.writes, self.report]

    def __str__(self) -> str:
        shown = ", ".join(_show_arg(a) for a in self.args)
        kw = "".join(f", {k}={_show_arg(v)}" for k, v in self.kwargs.items())
        return f"{', '.join(f'%{o}' for o in self.outs)} = {self.op}({shown}{kw})"


@dataclass(slots=True)
class _Transfer:
    """A step that moves the values in `slots` between this worker and `worker`, all in one
    transfer message."""

    kind: ClassVar[str]
    arrow: ClassVar[str]  # how it prints: "->" out, "<-" in
    slots: list[int]
    worker: str

    def params(self) -> list[int]:
        return []

    def wire(self) -> list:
        return [self.kind, self.slots, self.worker]

    def __str__(self) -> str:
        return f"{self.kind} {', '.join(f'%{v}' for v in self.slots)} {self.arrow} {self.worker}"


class Send(_Transfer):
    """Send the values in `slots` to `worker`, in one transfer message."""

    __slots__ = ()
    kind = "send"
    arrow = "->"

    def reads(self) -> list[int]:
        return list(self.slots)

    def defines(self) -> list[int]:
        return []


class Recv(_Transfer):
    """Wait for the transfer message of the values in `slots` from `worker`."""

    __slots__ = ()
    kind = "recv"
    arrow = "<-"

    def reads(self) -> list[int]:
        return []

    def defines(self) -> list[int]:
        return list(self.slots)


@dataclass(slots=True)
class _OneSlot:
    """A step about the value in one slot: it reads it and defines nothing."""

    kind: ClassVar[str]
    slot: int

    def reads(self) -> list[int]:
        return [self.slot]

    def defines(self) -> list[int]:
        return []

    def params(self) -> list[int]:
        return []

    def wire(self) -> list:
        return [self.kind, self.slot]

    def __str__(self) -> str:
        return f"{self.kind} %{self.slot}"


class Free(_OneSlot):
    """Drop the value in `slot` (after its last use on this worker)."""

    __slots__ = ()
    kind = "free"


class Return(_OneSlot):
    """Send the value in `slot` back to the client with the reply."""

    __slots__ = ()
    kind = "return"


Step = Call | Send | Recv | Free | Return


def to_wire(stages: list[list[Step]]) -> list[list[list]]:
    """A program (stages of steps) in the list form it travels in."""
    return [[step.wire() for step in stage] for stage in stages]


def parse_program(stages: Any, n_slots: int) -> tuple[list[Step], set[int]]:
    """(its steps, all stages in order; the parameters they use) of a program received in
    list form over `n_slots` slots, every step checked (`parse_step`)."""
    if not isinstance(stages, list) or not all(isinstance(st, list) for st in stages):
        raise MalformedStep("a program is a list of stages, each a list of steps")
    params: set[int] = set()
    steps = [parse_step(step, n_slots, params) for stage in stages for step in stage]
    return steps, params


def parse_step(step: Any, n_slots: int, params: set[int] | None = None) -> Step:
    """The step a list received says, refused (`MalformedStep`, or `OpRefused` for an op
    off the allowlist) when it is not well-formed or names a slot beyond `n_slots`; the
    parameters a call uses are added to `params`."""
    if not isinstance(step, list) or not step or not isinstance(step[0], str):
        raise MalformedStep(f"malformed step {step!r:.80}")
    kind = step[0]
    if kind == "call":
        if (
            len(step) != 7
            or not isinstance(step[2], list)
            or not isinstance(step[3], dict)
            or not all(isinstance(k, str) for k in step[3])
            or not isinstance(step[4], list)
            or not isinstance(step[5], list)
        ):
            raise MalformedStep("a call step is [call, op, args, kwargs, outs, writes, report]")
        _, op, args, kwargs, outs, writes, report = step
        resolve(op)
        call = Call(op, args, kwargs, outs, writes, report)
        for ref in call.refs():
            if type(ref) is Param:
                if params is not None:
                    params.add(ref.index)
            elif ref.index >= n_slots:
                raise MalformedStep(f"step refers to {ref!r}, beyond the program's values")
        if not all(type(s) is int and 0 <= s < n_slots for s in outs):
            raise MalformedStep("call outputs must be slots")
        for w in writes:
            if not (
                isinstance(w, list)
                and len(w) == 2
                and _is_path(w[0])
                and type(w[1]) is int
                and 0 <= w[1] < n_slots
                and w[1] in outs
            ):
                raise MalformedStep("call writes must be [argument path, output slot] pairs")
        if outs and len(outs) < len(writes):
            raise MalformedStep("a call writes more slots than it has outputs")
        return call
    if kind in ("send", "recv"):
        if (
            len(step) != 3
            or not isinstance(step[1], list)
            or not step[1]
            or not all(type(s) is int for s in step[1])
            or not isinstance(step[2], str)
        ):
            raise MalformedStep(f"a {kind} step is [{kind}, [slot, ...], worker]")
        if not all(0 <= s < n_slots for s in step[1]):
            raise MalformedStep(f"{kind} of a slot beyond the program's values")
        if len(set(step[1])) != len(step[1]):
            raise MalformedStep(f"a {kind} step names a slot twice")
        return (Send if kind == "send" else Recv)(step[1], step[2])
    if kind in ("free", "return"):
        if len(step) != 2 or type(step[1]) is not int or not 0 <= step[1] < n_slots:
            raise MalformedStep(f"a {kind} step is [{kind}, slot]")
        return (Free if kind == "free" else Return)(step[1])
    raise MalformedStep(f"unknown step kind {kind!r}")


def _is_path(path: Any) -> bool:
    """An argument path: a position, a keyword, or [path, index] into a tensor list."""
    if type(path) is int:
        return path >= 0
    if isinstance(path, str):
        return True
    return isinstance(path, list) and len(path) == 2 and _is_path(path[0]) and type(path[1]) is int


def _refs_in(obj: Any, out: list) -> None:
    for a in obj:
        if type(a) is Slot or type(a) is Param:
            out.append(a)
        elif isinstance(a, list):
            _refs_in(a, out)


def _show_arg(a: Any) -> str:
    if type(a) is Slot:
        return f"%{a.index}"
    if type(a) is Param:
        return f"${a.index}"
    if isinstance(a, list):
        return "[" + ", ".join(_show_arg(x) for x in a) + "]"
    return repr(a)
