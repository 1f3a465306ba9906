"""Sweep the allowlisted ops that take an index tensor, a size or a scale with adversarial
values, each call in a child process, through the checks a worker makes before it runs one.

Which ops: every op on the allowlist (gridgraph/trace/allowlist.py) whose schema has an
int, SymInt, int[] or SymInt[] argument, a float argument named as a scale, or a tensor
argument that its sample calls pass as integers (`swept_arguments`). Their sample calls come
from PyTorch's OpInfo samples (forward, backward and in-place variants; `capture`), up to
`--per-op` calls of different argument kinds per op; an op no sample reaches is listed as
not swept.

What values: each swept argument of each sample call, one at a time, set to each value of
its kind (`ADVERSARIAL`: negative, past the end of every input dimension, 2**31, 2**32 + 1,
INT64_MIN and INT64_MAX; 1e-20, 0, -1, NaN, +-inf and 1e20 for scales; an index tensor's
first and last elements set to each integer value its dtype holds; a list's first and last entries).

How each case runs (`run_case`): in a forked child, the inputs laid out as views into larger
buffers whose margins hold a known byte pattern (a canary), the call goes the worker's way
(prepare.CompiledCall: its meta footprint, the limits, kernel_checks, the run, the bounds of
its result); in a second child the same call on the margins' other pattern, and in a third
plain torch. A case is then:
- refused: before its kernel ran (by its meta kernel, the limits, kernel_checks or
  as_strided_'s layout check);
- torch refuses: its kernel ran and raised torch's own error;
- ran, equal: it ran and gave what plain torch gives (results and inputs, bit for bit);
- a finding: the worker's way crashed (a signal in the child), timed out, wrote a margin,
  gave results that depend on the margins' bytes (read outside its inputs), or differs from
  plain torch. Refusals of what plain torch computes are counted apart (`over-refused`),
  with whether plain torch crashed, wrote or read outside its inputs on the same values.

    python scripts/sweep_kernels.py                       # all, table to docs/kernel_sweep.md
    python scripts/sweep_kernels.py --ops 'nll_loss|upsample' --table -   # a slice, printed

Inputs that share storage in the sample call are given storages of their own, and a random
op is compared with plain torch drawing from the same generator state as the worker's. What
it cannot see: a write past an op's own output (a fresh allocation, no margin) unless it
crashes, and a read whose value reaches no result; so a refusal counted as over-refused may
still guard such a write (nll_loss_backward's target on its last row). The ops that address
their input's whole storage (`WHOLE_STORAGE`: as_strided, resize_) read the margins as
their own.
"""

from __future__ import annotations

import argparse
import faulthandler
import hashlib
import math
import os
import pickle
import re
import resource
import signal
import sys
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from gridgraph.exec.safety.kernel_checks import KernelArgumentRefused
from gridgraph.exec.safety.limits import LimitExceeded, Limits, data_dependent_footprint
from gridgraph.exec.worker.ops import RandomState, ViewOutOfBounds, check_bounds, check_view
from gridgraph.exec.worker.prepare import CompiledCall
from gridgraph.schedule.program import Call, Param
from gridgraph.trace.allowlist import ALLOWED, UNINITIALIZED, OpRefused, resolve
from gridgraph.trace.graph import op_name

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
PAST_THE_END = "past the end"  # one more than the largest dimension of any input
ADVERSARIAL = {
    "int": (-1, -2, PAST_THE_END, 2**31, 2**32 + 1, INT64_MIN, INT64_MAX),
    "scale": (1e-20, 0.0, -1.0, math.nan, math.inf, -math.inf, 1e20, 5e-324),
    "index tensor": (-1, PAST_THE_END, 2**31, INT64_MIN, INT64_MAX),
}
MARGIN_BYTES = 4096  # canary bytes each side of every input
PATTERNS = (0x3C, 0x41)  # (small, positive floats in every float dtype)
LIMITS = Limits(max_client_memory=1 << 30, max_request_seconds=10.0)
CHILD_SECONDS = 30  # a child running longer is stopped: a timeout
CHILD_ADDRESS_SPACE = 16 << 30  # so that a huge allocation fails fast rather than swap
REFUSED = ("meta", "limits", "kernel_checks", "footprint", "layout")


# --- which ops and arguments -------------------------------------------------------------


def swept_arguments(op: torch._ops.OpOverload) -> list[tuple[str, str, bool]]:
    """(name, kind, whether a list) of `op`'s arguments that a sweep sets: ints and int
    lists ("int"), scales ("scale"), and tensors ("tensor": swept when a sample passes
    integers)."""
    found = []
    for a in op._schema.arguments:
        text = str(a.type).removeprefix("Optional[").rstrip("]")
        is_list = text.startswith("List[")
        text = text.removeprefix("List[")
        if text in ("int", "SymInt"):
            found.append((a.name, "int", is_list))
        elif text == "float" and "scale" in a.name:
            found.append((a.name, "scale", is_list))
        elif text == "Tensor" and not is_list:
            found.append((a.name, "tensor", False))
    return found


def in_scope(op: torch._ops.OpOverload) -> bool:
    """Whether `op` has a size or scale argument (an index tensor shows only in samples)."""
    return any(kind != "tensor" for _, kind, _ in swept_arguments(op))


# --- sample calls --------------------------------------------------------------------------


@dataclass
class Sample:
    """One call of an op as a sample made it: its arguments by schema position."""

    name: str
    args: list
    kwargs: dict


def capture(names: set[str], per_op: int, opinfos: str | None = None) -> dict[str, list[Sample]]:
    """Up to `per_op` sample calls of each op in `names` (distinct in their arguments'
    dtypes, ranks and constants), from PyTorch's OpInfo samples (those whose name matches
    `opinfos`, when given), forward (with and without autograd), backward and in place, in
    float32, int64 and uint8."""
    from torch.testing._internal.common_methods_invocations import op_db
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    found: dict[str, list[Sample]] = {}
    kinds: dict[str, set] = {}

    class Capture(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            name = op_name(func)
            if name in names and len(found.get(name, ())) < per_op:
                kind = _kind_of(args, kwargs)
                if kind not in kinds.setdefault(name, set()):
                    kinds[name].add(kind)
                    found.setdefault(name, []).append(Sample(name, *_detached(args, kwargs)))
            return func(*args, **kwargs)

    warnings.simplefilter("ignore")
    for opinfo in op_db:
        if opinfos and not re.search(opinfos, opinfo.name):
            continue
        for dtype in (torch.float32, torch.int64, torch.uint8):
            if dtype not in opinfo.supported_dtypes("cpu"):
                continue
            grad = opinfo.supports_autograd and dtype.is_floating_point
            try:
                samples = list(opinfo.sample_inputs("cpu", dtype, requires_grad=grad))
            except Exception:
                continue
            for sample in samples:
                try:
                    with Capture():
                        out = opinfo(sample.input, *sample.args, **sample.kwargs)
                        leaves = [t for t in tree_leaves(out)
                                  if isinstance(t, torch.Tensor) and t.requires_grad]  # fmt: skip
                        if leaves:
                            torch.autograd.backward([t.sum() for t in leaves])
                except Exception:
                    pass
                if grad:  # (without autograd some ops take another kernel: embedding_bag)
                    try:
                        args, kwargs = _detached([sample.input, *sample.args], sample.kwargs)
                        with torch.no_grad(), Capture():
                            opinfo(*args, **kwargs)
                    except Exception:
                        pass
                if opinfo.inplace_variant is None:
                    continue
                try:  # (on copies: the in-place op changes its first input)
                    args, kwargs = _detached([sample.input, *sample.args], sample.kwargs)
                    with torch.no_grad(), Capture():
                        opinfo.inplace_variant(*args, **kwargs)
                except Exception:
                    pass
    return found


def _kind_of(args: tuple, kwargs: dict) -> tuple:
    def one(a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            return ("tensor", a.dtype, a.dim())
        if isinstance(a, (list, tuple)):
            return tuple(one(x) for x in a)
        return repr(a)

    return tuple(one(a) for a in args) + tuple((k, one(v)) for k, v in sorted(kwargs.items()))


def _detached(args: tuple, kwargs: dict) -> tuple[list, dict]:
    def one(a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            return a.detach().clone()
        if isinstance(a, (list, tuple)):
            return type(a)(one(x) for x in a)
        return a

    return [one(a) for a in args], {k: one(v) for k, v in kwargs.items()}


# --- cases ---------------------------------------------------------------------------------


@dataclass
class Case:
    """A sample call with one argument set to an adversarial value."""

    name: str
    argument: str
    value: str
    args: list
    kwargs: dict


def cases(sample: Sample) -> list[Case]:
    """The sweep's cases of one sample call (see the module's docstring)."""
    op = resolve(sample.name)
    positions = {a.name: i for i, a in enumerate(op._schema.arguments)}
    past = 1 + max(
        [d for a in _tensors(sample.args, sample.kwargs) for d in (*a.shape, a.dim())], default=1
    )
    made = []
    for name, kind, is_list in swept_arguments(op):
        i = positions[name]
        given = sample.args[i] if i < len(sample.args) else sample.kwargs.get(name)
        if given is None and is_list:  # (an optional list left out: a list of one)
            given = [0]
        for label, value in _values(kind, given, past):
            args, kwargs = list(sample.args), dict(sample.kwargs)
            if i < len(args):
                args[i] = value
            else:
                kwargs[name] = value
            made.append(Case(sample.name, name, label, args, kwargs))
    return made


def _values(kind: str, given: Any, past: int) -> list[tuple[str, Any]]:
    """(label, value) of each adversarial value for an argument of `kind` given as `given`."""
    if kind == "tensor":
        if not isinstance(given, torch.Tensor) or given.numel() == 0:
            return []
        if given.is_floating_point() or given.is_complex() or given.dtype == torch.bool:
            return []
        info, out = torch.iinfo(given.dtype), {}
        for where, at in (("first", 0), ("last", -1)):
            for v in ADVERSARIAL["index tensor"]:
                v = max(info.min, min(info.max, past if v == PAST_THE_END else v))
                t = given.contiguous().clone()
                t.view(-1)[at] = v
                out[f"{where} element {v}"] = t
        return list(out.items())
    if kind == "scale":
        values = ADVERSARIAL["scale"]
        if isinstance(given, (list, tuple)):
            return [(f"[{v!r}, ...]", [v] * len(given)) for v in values]
        return [(repr(v), v) for v in values]
    ints = [past if v == PAST_THE_END else v for v in ADVERSARIAL["int"]]
    if isinstance(given, (list, tuple)):
        spots = sorted({0, len(given) - 1}) if given else []
        return [
            (f"[{j}] = {v}", [v if k == j else x for k, x in enumerate(given)])
            for j in spots
            for v in ints
        ]
    return [(str(v), v) for v in ints]


# --- running one case ----------------------------------------------------------------------


def _tensors(args: list, kwargs: dict) -> list[torch.Tensor]:
    out = []
    for a in [*args, *kwargs.values()]:
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(x for x in a if isinstance(x, torch.Tensor))
    return out


def _guarded(t: torch.Tensor, pattern: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """`t`'s layout and values in the middle of a buffer whose MARGIN_BYTES either side hold
    `pattern`: (the view, the buffer, the margin's elements)."""
    size = t.element_size()
    margin = -(-MARGIN_BYTES // size)
    stored = t.untyped_storage().nbytes() // size
    buffer = torch.empty(margin * 2 + stored, dtype=t.dtype)
    raw = buffer.view(torch.uint8)
    raw.fill_(1 if t.dtype == torch.bool else pattern)
    inner = raw[margin * size : (margin + stored) * size]
    inner.copy_(torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()))
    view = buffer.as_strided(t.shape, t.stride(), margin + t.storage_offset())
    return view, buffer, margin


def _laid_out(args: list, kwargs: dict, pattern: int) -> tuple[list, dict, list]:
    """The call's arguments with each tensor `_guarded`; the (buffer, margin) of each."""
    guards = []

    def one(a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            view, buffer, margin = _guarded(a, pattern)
            guards.append((buffer, margin, a.dtype == torch.bool))
            return view
        if isinstance(a, (list, tuple)):
            return type(a)(one(x) for x in a)
        return a

    return [one(a) for a in args], {k: one(v) for k, v in kwargs.items()}, guards


def _margins_intact(guards: list, pattern: int) -> bool:
    for buffer, margin, is_bool in guards:
        raw = buffer.view(torch.uint8)
        edge = margin * buffer.element_size()
        want = 1 if is_bool else pattern
        if bool((raw[:edge] != want).any()) or bool((raw[-edge:] != want).any()):
            return False
    return True


def _digest(result: Any, args: list, kwargs: dict) -> str:
    """A hash of every tensor the call returned and of its inputs after it (in place ops)."""
    h = hashlib.sha256()
    returned = result if isinstance(result, (tuple, list)) else [result]
    for t in [*_tensors(list(returned), {}), *_tensors(args, kwargs)]:
        h.update(repr((t.dtype, tuple(t.shape))).encode())
        h.update(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    if not isinstance(result, (torch.Tensor, tuple, list)):
        h.update(repr(result).encode())
    return h.hexdigest()


def _as_worker(case: Case, pattern: int) -> dict:
    """The case the worker's way (see the module's docstring)."""
    args, kwargs, guards = _laid_out(case.args, case.kwargs, pattern)
    params: dict[int, Any] = {}

    def ref(a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            params[len(params)] = a
            return Param(len(params) - 1)
        if isinstance(a, (list, tuple)):
            return [ref(x) for x in a]
        return a

    step = Call(case.name, [ref(a) for a in args], {k: ref(v) for k, v in kwargs.items()},
                [0], [], False)  # fmt: skip
    call = CompiledCall(step)
    args, kwargs = call.arguments(None, [], params)
    outcome: dict[str, Any] = {}
    try:
        footprint = call.footprint(args, kwargs)
    except Exception as e:
        return {"refused": "meta", "error": _said(e)}
    try:
        if footprint is None:
            footprint = data_dependent_footprint(call.op, args, kwargs)
        LIMITS.check_memory(footprint[0], case.name)
        LIMITS.check_work(footprint[1], case.name)
    except LimitExceeded as e:
        return {"refused": "limits", "error": _said(e)}
    except Exception as e:
        return {"refused": "footprint", "error": _said(e)}
    try:
        result = call.run(RandomState(), args, kwargs)
    except KernelArgumentRefused as e:
        outcome.update(refused="kernel_checks", error=_said(e))
    except OpRefused as e:  # (raised before the kernel: as_strided_'s layout check)
        outcome.update(refused="layout", error=_said(e))
    except Exception as e:
        outcome["error"] = _said(e)
    else:
        try:
            check_view(result)
            outcome["digest"] = _digest(result, args, kwargs)
        except OpRefused as e:
            outcome.update(refused="bounds", error=_said(e))
        except Exception as e:
            outcome["error"] = _said(e)
    outcome["margins"] = _margins_intact(guards, pattern)
    return outcome


def _as_torch(case: Case, pattern: int) -> dict:
    """The case in plain torch, the random stream set as the worker's starts."""
    args, kwargs, guards = _laid_out(case.args, case.kwargs, pattern)
    torch.set_rng_state(torch.Generator().get_state())
    outcome: dict[str, Any] = {}
    try:
        result = resolve(case.name)(*args, **kwargs)
        outcome["digest"] = _digest(result, args, kwargs)
        outside = _outside(result)
        if outside:
            outcome["outside"] = outside
    except Exception as e:
        outcome["error"] = _said(e)
    outcome["margins"] = _margins_intact(guards, pattern)
    return outcome


def _outside(result: Any) -> str | None:
    """How a tensor `result` holds (a strided one on the CPU) reaches outside its storage,
    if one does: plain torch's as_strided_ makes such views, and reads past them later."""
    for t in _tensors(list(result) if isinstance(result, (tuple, list)) else [result], {}):
        if t.layout == torch.strided and t.is_cpu:
            try:
                check_bounds(t)
            except ViewOutOfBounds as e:
                return _said(e)
            except OpRefused:  # (too many dimensions for the wire: no view outside)
                pass
    return None


def _said(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"


def in_child(work: Any, *args: Any, seconds: int = CHILD_SECONDS) -> Any:
    """`work(*args)` in a forked child: what it returned, or the signal that ended it
    ({"signal": n}; SIGALRM after `seconds`)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        os.close(read)
        try:
            _confine_child()
            signal.alarm(seconds)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                data = pickle.dumps(work(*args))
            with os.fdopen(write, "wb") as out:
                out.write(data)
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as got:
        data = got.read()
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return {"signal": os.WTERMSIG(status)}
    return pickle.loads(data) if data else {"signal": 0}


def _confine_child() -> None:
    """A child's address space bounded, no core dumped, its stderr (glibc's complaints) gone."""
    resource.setrlimit(resource.RLIMIT_AS, (CHILD_ADDRESS_SPACE, CHILD_ADDRESS_SPACE))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
    faulthandler.disable()  # (a crash is what a case may do: reported, not printed)
    warnings.simplefilter("ignore")


@dataclass
class Outcome:
    """What one case did: `verdict` is one of VERDICTS, `detail` says how."""

    case: Case
    verdict: str
    detail: str
    worker: dict = field(default_factory=dict)
    torch: dict = field(default_factory=dict)


# Ops that address their input's whole storage, which holds the margins here: what they read
# there is theirs (the worker bounds their results by the storage).
WHOLE_STORAGE = frozenset({"aten::as_strided", "aten::as_strided_copy", "aten::as_strided_",
                           "aten::as_strided_scatter", "aten::resize_",
                           "aten::resize_as_"})  # fmt: skip
VERDICTS = ("refused", "torch refuses", "ran, equal", "over-refused", "finding")


def run_case(case: Case) -> Outcome:
    """Run `case` the worker's way (on both margin patterns) and in plain torch, each in a
    child of its own; judge it."""
    first = in_child(_as_worker, case, PATTERNS[0])
    ran = _ran(first)
    plain = in_child(_as_torch, case, PATTERNS[0]) if ran else _plain_torch(case)
    second = in_child(_as_worker, case, PATTERNS[1]) if ran else None
    return judge(case, first, plain, second)


def _plain_torch(case: Case) -> dict:
    """`_as_torch` of a case the worker's way refused, in a child of its own; when it
    computes it, again on the other margin pattern: "unsafe" says how it went wrong there
    (a signal, a margin written, a result that depends on the margins' bytes, a view that
    reaches outside its storage)."""
    plain = in_child(_as_torch, case, PATTERNS[0])
    if "outside" in plain:
        plain["unsafe"] = f"plain torch returns a view outside its storage ({plain['outside']})"
    elif "digest" in plain and plain["margins"]:
        other = in_child(_as_torch, case, PATTERNS[1])
        if "signal" in other:
            plain["unsafe"] = f"plain torch ends in signal {other['signal']} on other bytes"
        elif not other["margins"]:
            plain["unsafe"] = "plain torch writes outside its inputs on other bytes"
        elif other.get("digest") != plain["digest"]:
            plain["unsafe"] = "plain torch reads outside its inputs"
    return plain


def run_cases(batch: list[Case]) -> list[Outcome]:
    """`run_case` of each case, made cheaper: the cases run in turn in one child (a fork
    costs more than most cases), which reports each before it starts the next; a case
    it did not report (the child died) is run again alone (`run_case`), and the rest in
    a new child. A case that crashes the shared child but not its own is a finding too:
    an earlier case left the heap corrupted."""
    outcomes: list[Outcome] = []
    while len(outcomes) < len(batch):
        done = len(outcomes)
        for first, plain, second in _in_one_child(batch[done:]):
            case = batch[len(outcomes)]
            if plain is None:  # (refused: plain torch may be unsafe, so alone)
                plain = _plain_torch(case)
            outcomes.append(judge(case, first, plain, second))
        if len(outcomes) < len(batch):  # the child died in this case
            alone = run_case(batch[len(outcomes)])
            if alone.verdict != "finding" and len(outcomes) > done:
                before = outcomes[-1].case
                alone = Outcome(alone.case, "finding", "it crashed the child that ran "
                                f"{before.name} {before.argument} = {before.value} before it, "
                                "but not alone: that case may have corrupted the heap")  # fmt: skip
            outcomes.append(alone)
    return outcomes


def _in_one_child(batch: list[Case]) -> Any:
    """Yield (worker's way, plain torch, worker's way on other margins) of each case in
    turn, run in one forked child, until it has run them all or dies; the last two None
    where the worker's way did not run the case."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            _confine_child()
            with os.fdopen(write, "wb") as out:
                for case in batch:
                    signal.alarm(CHILD_SECONDS)
                    first = _as_worker(case, PATTERNS[0])
                    ran = _ran(first)
                    plain = _as_torch(case, PATTERNS[0]) if ran else None
                    second = _as_worker(case, PATTERNS[1]) if ran else None
                    pickle.dump((first, plain, second), out)
                    out.flush()
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as got:
        while True:
            try:
                yield pickle.load(got)
            except (EOFError, pickle.UnpicklingError):
                break
    os.waitpid(pid, 0)


def _ran(first: dict) -> bool:
    return "signal" not in first and first.get("margins", True) and "refused" not in first


def judge(case: Case, first: dict, plain: dict, second: dict | None) -> Outcome:
    """The verdict on a case from what it did the worker's way (`first`; `second`, on
    the other margin pattern, when it ran) and in plain torch (`plain`)."""
    unsafe_in_torch = _unsafe(plain)

    def out(verdict: str, detail: str) -> Outcome:
        return Outcome(case, verdict, detail, first, plain)

    if "signal" in first:
        name = "a timeout" if first["signal"] == signal.SIGALRM else f"signal {first['signal']}"
        return out("finding", f"the worker's way ended in {name}")
    if not first.get("margins", True):
        return out("finding", "the worker's way wrote outside its inputs")
    if first.get("refused") in REFUSED:
        if "digest" in plain and not unsafe_in_torch:
            return out("over-refused", f"{first['error']} (plain torch computes it)")
        why = unsafe_in_torch or "plain torch refuses it too"
        return out("refused", f"by {first['refused']}: {first['error']} ({why})")
    if first.get("refused") == "bounds":
        return out("finding", f"its result reached outside its storage: {first['error']}")
    if second is None or "signal" in second or not second.get("margins", True):
        return out("finding", "the worker's way failed on other bytes around its inputs")
    if first.get("digest") != second.get("digest") and case.name not in WHOLE_STORAGE:
        return out("finding", "its result depends on the bytes around its inputs")
    if "error" in first:
        return out("torch refuses", first["error"])
    name = case.name.removeprefix("aten::").split(".")[0]
    if "digest" in plain and (plain["digest"] == first["digest"] or name in UNINITIALIZED):
        return out("ran, equal", "")
    return out("finding", f"ran, but plain torch gives {plain}")


def _unsafe(plain: dict) -> str | None:
    """How plain torch went wrong on a case, if it did."""
    if "signal" in plain:
        return f"plain torch ends in signal {plain['signal']}"
    if not plain.get("margins", True):
        return "plain torch writes outside its inputs"
    return plain.get("unsafe")


# --- the sweep and its table ---------------------------------------------------------------


def sweep(
    samples: dict[str, list[Sample]], progress: bool = False, kept: str | None = None
) -> list[Outcome]:
    """Every case of every sample, run and judged; each op's outcomes kept in the folder
    `kept` when given, and taken from there when there already (a sweep resumes)."""
    outcomes = []
    for name in sorted(samples):
        path = _kept_path(kept, name) if kept else None
        if path and os.path.exists(path):
            with open(path, "rb") as f:
                outcomes.extend(pickle.load(f))
            continue
        started, before = time.monotonic(), len(outcomes)
        for sample in samples[name]:
            outcomes.extend(run_cases(cases(sample)))
        if path:
            with open(path + ".part", "wb") as f:
                pickle.dump(outcomes[before:], f)
            os.replace(path + ".part", path)
        if progress:
            print(f"{name}: {time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)
    return outcomes


def _kept_path(folder: str, name: str) -> str:
    return os.path.join(folder, name.replace("::", "-") + ".pickle")


def summary(outcomes: list[Outcome], in_scope_ops: list[str], swept_ops: list[str]) -> str:
    counts = Counter(o.verdict for o in outcomes)
    return (
        f"ops in scope: {len(in_scope_ops)}, swept: {len(swept_ops)} "
        f"({len(set(in_scope_ops) - set(swept_ops))} not swept); cases: {len(outcomes)}; "
        + ", ".join(f"{v}: {counts.get(v, 0)}" for v in VERDICTS)
    )


def table(outcomes: list[Outcome], in_scope_ops: list[str], swept_ops: list[str]) -> str:
    by_op: dict[str, Counter] = {}
    for o in outcomes:
        by_op.setdefault(o.case.name, Counter())[o.verdict] += 1
    lines = [
        "# Kernel sweep",
        "",
        "Made by `scripts/sweep_kernels.py` (its docstring says how each case runs and is",
        "judged): one sample call per op, `python scripts/sweep_kernels.py --per-op 1`.",
        "",
        summary(outcomes, in_scope_ops, swept_ops),
        "",
        "| op | swept arguments | cases | " + " | ".join(VERDICTS) + " |",
        "|---|---|---|" + "---|" * len(VERDICTS),
    ]
    for name in swept_ops:
        c = by_op.get(name, Counter())
        swept = ", ".join(n for n, _, _ in swept_arguments(resolve(name)))
        lines.append(f"| {name} | {swept} | {sum(c.values())} | "
                     + " | ".join(str(c.get(v, 0)) for v in VERDICTS) + " |")  # fmt: skip
    for verdict in ("finding", "over-refused"):
        picked = [o for o in outcomes if o.verdict == verdict]
        lines += ["", f"## {verdict} ({len(picked)})", ""]
        lines += [f"- {o.case.name} {o.case.argument} = {o.case.value}: {o.detail}"
                  for o in picked]  # fmt: skip
    missing = sorted(set(in_scope_ops) - set(swept_ops))
    lines += ["", f"## in scope, not swept ({len(missing)})", "",
              "No sample reached them, or this run stopped before them (`--report-only`).", "",
              ", ".join(missing)]  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", help="sweep only the ops whose name matches this regex")
    parser.add_argument("--opinfos", help="take samples only from OpInfos matching this regex")
    parser.add_argument("--per-op", type=int, default=3, help="sample calls per op (3)")
    parser.add_argument("--table", default="docs/kernel_sweep.md", help="where, or - to print")
    parser.add_argument("--samples", help="a file to keep the samples in, and reuse them from")
    parser.add_argument("--kept", help="a folder to keep each op's outcomes in, and resume from")
    parser.add_argument("--report-only", action="store_true",
                        help="sweep nothing: the table of the outcomes in --kept")  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(1)  # (before any op: the children fork from this process)
    ops = sorted(n for n in ALLOWED if (not args.ops or re.search(args.ops, n)))
    if args.samples and os.path.exists(args.samples):
        with open(args.samples, "rb") as f:
            samples = {n: s for n, s in pickle.load(f).items() if n in ops}
    else:  # (in a child: this process stays small, so forking one per case stays cheap)
        samples = in_child(capture, set(ops), args.per_op, args.opinfos, seconds=3600)
        if "signal" in samples:
            sys.exit(f"taking the samples ended in signal {samples['signal']}")
        if args.samples:
            with open(args.samples, "wb") as f:
                pickle.dump(samples, f)
    scope = [n for n in ops if in_scope(resolve(n)) or any(
        _values("tensor", t, 1) for s in samples.get(n, ()) for t in _tensors(s.args, s.kwargs)
    )]  # fmt: skip
    swept = [n for n in scope if n in samples]
    if args.report_only:  # (the ops whose outcomes are kept)
        swept = [n for n in swept if os.path.exists(_kept_path(args.kept, n))]
    if args.kept:
        os.makedirs(args.kept, exist_ok=True)
    outcomes = sweep({n: samples[n] for n in swept}, progress=True, kept=args.kept)
    text = table(outcomes, scope, swept)
    if args.table == "-":
        print(text)
    else:
        with open(args.table, "w") as f:
            f.write(text)
    print(summary(outcomes, scope, swept))


if __name__ == "__main__":
    main()
