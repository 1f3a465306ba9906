"""One OpInfo entry, one dtype, one mode: run its samples through pointers, compare with torch.

A *unit* is (entry, dtype, mode); `run_unit` returns one `Outcome` for it:

    pass      every sample gives what plain torch gives on the same inputs
    refused   the entry is in `refused.REFUSED` and raised `gg.GridError` (or a subclass) at
              the call for some sample, and the others passed
    fail      anything else: an error at the call or at `.get()`, a wrong value, a refusal
              of an entry that is not in the list (the sweep adds crashes and hangs)

Modes:
    eager       the op runs at once on pointers (no `gg.trace()`)
    traced      the op is recorded inside `gg.trace()`; `gg.compute` runs it, `.get()` reads it
    bwd-eager   float32 `requires_grad` pointers: `torch.autograd.grad` of the op's outputs
    bwd-traced  (fixed random cotangents), gradients against local ones; eager, or the op and
                its backward recorded inside one `gg.trace()`

Inputs: every tensor of a sample (input, args, kwargs, nested lists) is sent to the grid,
alternating between w0 and w1, so most ops have operands on two workers. The reference is
the same op on local copies of the same tensors. A sample that torch itself rejects must be
rejected through pointers too (any error).

Comparison is structural (tensors, tuples, lists, numbers): same type, dtype and shape; values
bit-equal (NaN equal to NaN), or within the entry's own tolerance for the dtype where bit
equality fails (`tolerance`: pointers record composite ops as the ATen ops they decompose
into, and a kernel may reduce in another order once an operand has been made contiguous).
Mutated inputs are compared as well. Random ops seed torch's generator with 42 inside the op
(OpInfo's `wrapper_set_seed`); the workers are seeded with 42 before every sample
(`grid.manual_seed(42)`), so the streams are the same.
"""

from __future__ import annotations

import collections
import importlib
import itertools
import math
import os
import time
import traceback
import warnings
from dataclasses import dataclass, field

import torch
from torch.testing._comparison import default_tolerances
from torch.testing._internal.common_device_type import precisionOverride, toleranceOverride
from torch.testing._internal.opinfo.core import DecorateInfo

import gridgraph as gg
from tests.conformance.refused import REFUSAL_ERRORS, REFUSED

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "int64": torch.int64,
    "bool": torch.bool,
    "complex64": torch.complex64,
    "bfloat16": torch.bfloat16,
}
MODES = ("eager", "traced", "bwd-eager", "bwd-traced")

# float32 forward runs every CPU sample the entry yields; the rest at least this many.
FIRST_SAMPLES = 3


@dataclass
class Outcome:
    """What one unit gave: `status` is pass / refused / fail; `kind` says how it failed."""

    entry: str
    dtype: str
    mode: str
    status: str
    kind: str = ""  # fail: error | wrong | refusal | crash | timeout
    message: str = ""  # first line of the failure
    samples: int = 0  # samples checked
    inexact: int = 0  # samples equal only within tolerance
    rejected: int = 0  # samples torch rejects, and the pointers too
    slowest: float = 0.0  # seconds, the slowest sample
    failed: int = 0  # samples that failed (a ModuleInfo unit runs them all)
    detail: list[str] = field(default_factory=list)  # traceback summary of the failure


def entry_id(op) -> str:
    """The entry's name as the suite reports it: `name` or `name.variant`."""
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


def load_entries() -> dict:
    """OpInfo entries by id, in op_db order; plus the `EXTRA_OPS` of the module named by
    $GG_CONFORMANCE_EXTRA (the harness's own self-tests add ops that crash or hang)."""
    from torch.testing._internal.common_methods_invocations import op_db

    ops = list(op_db)
    if os.environ.get("GG_CONFORMANCE_EXTRA"):
        ops += importlib.import_module(os.environ["GG_CONFORMANCE_EXTRA"]).EXTRA_OPS
    return {entry_id(op): op for op in ops}


def units_of(op, dtypes=tuple(DTYPES), modes=MODES) -> list[tuple[str, str]]:
    """The (dtype, mode) units the suite runs for an entry."""
    supported = op.supported_dtypes("cpu")
    out = []
    for name in dtypes:
        if DTYPES[name] not in supported:
            continue
        out += [(name, m) for m in modes if m in ("eager", "traced")]
    if op.supports_autograd and torch.float32 in op.supported_backward_dtypes("cpu"):
        out += [("float32", m) for m in modes if m.startswith("bwd")]
    return out


class SampleFailure(Exception):
    """A sample did not give what torch gives; `kind` is error, wrong or refusal."""

    def __init__(self, kind: str, message: str, detail: list[str] | None = None) -> None:
        super().__init__(message)
        self.kind, self.detail = kind, detail or []


def run_unit(op, dtype: str, mode: str, progress=lambda i: None) -> Outcome:
    """Run one unit of an OpInfo entry on a fresh 2-worker local grid."""
    entry = entry_id(op)
    grad = mode.startswith("bwd")
    limit = None if (dtype == "float32" and not grad) else FIRST_SAMPLES
    verdicts: collections.Counter = collections.Counter()
    slowest = 0.0
    try:
        samples = op.sample_inputs("cpu", DTYPES[dtype], requires_grad=grad)
        with gg.local_grid(2) as grid, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for i, sample in enumerate(itertools.islice(samples, limit)):
                progress(i)
                start = time.monotonic()
                try:
                    traced = mode.endswith("traced")
                    verdicts[check_sample(grid, op, sample, traced, backward=grad)] += 1
                    slowest = max(slowest, time.monotonic() - start)
                except SampleFailure as f:
                    if f.kind == "refusal" and entry in REFUSED:
                        verdicts["refused"] += 1
                        continue
                    message = first_line(f)
                    return Outcome(entry, dtype, mode, "fail", f.kind, message, i, detail=f.detail)
    except Exception as e:  # the harness itself (sample generation, grid setup)
        return Outcome(entry, dtype, mode, "fail", "error", describe(e), detail=summary(e))
    return Outcome(
        entry,
        dtype,
        mode,
        "refused" if verdicts["refused"] else "pass",
        samples=sum(verdicts.values()),
        inexact=verdicts["close"],
        rejected=verdicts["rejected"],
        slowest=round(slowest, 3),
    )


# --- one sample --------------------------------------------------------------------------
# Each check returns its verdict: "exact" (bit-equal), "close" (within tolerance) or
# "rejected" (torch raises on this sample, and so do the pointers); else SampleFailure.


def check_sample(grid: gg.Grid, op, sample, traced: bool, backward: bool) -> str:
    """The op (or its gradients) on pointers against torch on local copies of the inputs."""

    def run(parts):
        return gradients(op, sample, parts) if backward else call(op, parts)

    def same(got, got_parts, expected, parts) -> bool:
        if backward:
            return compare(got, expected, "gradients", op)
        # Outputs such as torch.empty's are uninitialised memory: type, dtype and shape only.
        uninitialised = getattr(op, "has_nondeterministic_output", False)
        exact = compare(got, expected, "output", op, uninitialised=uninitialised)
        return compare(got_parts, parts, "inputs after the call", op) and exact

    local = map_tensors(clone, sample_parts(sample))
    try:
        expected = run(local)
    except Exception as e:
        return both_reject(e, lambda: fetched(run_remote(grid, sample, traced, run)))
    got, got_parts = fetched(run_remote(grid, sample, traced, run))
    try:
        exact = same(got, got_parts, expected, local)
    except SampleFailure as failure:
        # Sending stores a tensor's values, contiguous: not its strides, nor the storage a
        # view shares with its base. Where that layout changes torch's answer (as_strided, or
        # a kernel's order of summation), compare with torch on the tensors the workers hold.
        sent = map_tensors(as_sent, sample_parts(sample))
        if all(a.stride() == b.stride() for a, b in zip(tensors_in(sent), tensors_in(local))):
            raise
        try:
            exact = same(got, got_parts, run(sent), sent)
        except Exception:
            raise failure from None
    return "exact" if exact else "close"


def run_remote(grid: gg.Grid, sample, traced: bool, fn) -> tuple:
    """`fn(parts)` on the sample sent to the grid; returns (result, the pointer parts)."""
    remote = spread(grid, sample_parts(sample))
    grid.manual_seed(42)

    def run():
        if not traced:
            return fn(remote)
        with gg.trace():
            return fn(remote)

    return at_call(run), remote


def both_reject(torch_error: Exception, through_pointers) -> str:
    """Torch rejects the sample: the pointers must reject it too (any error will do)."""
    try:
        through_pointers()
    except Exception:
        return "rejected"
    raise SampleFailure(
        "wrong", f"torch rejects this sample ({describe(torch_error)}) but the pointers ran it"
    )


def gradients(op, sample, parts) -> list:
    """d(outputs . cotangents)/d(inputs that require grad); cotangents fixed by a seed."""
    leaves = [t for t in tensors_in(parts) if t.requires_grad]
    out = sample.output_process_fn_grad(call(op, parts))
    outs = [t for t in tensors_in(out) if t.requires_grad]
    if not outs or not leaves:
        return []
    g = torch.Generator().manual_seed(0)
    cotangents = [torch.randn(t.shape, dtype=t.dtype, generator=g) for t in outs]
    return list(torch.autograd.grad(outs, leaves, cotangents, allow_unused=True))


def sample_parts(sample) -> tuple:
    return (sample.input, tuple(sample.args), dict(sample.kwargs))


def call(op, parts: tuple):
    inp, args, kwargs = parts
    return op(inp, *args, **kwargs)


def at_call(fn):
    """Run the call; an error there is a refusal (GridError) or a failure (anything else)."""
    try:
        return fn()
    except REFUSAL_ERRORS as e:
        raise SampleFailure("refusal", f"{type(e).__name__}: {first_line(e)}", summary(e)) from e
    except Exception as e:
        raise SampleFailure("error", f"at the call: {describe(e)}", summary(e)) from e


def fetched(obj):
    """`obj` with every pointer replaced by its value (all computed together first)."""
    pointers = [t for t in tensors_in(obj) if isinstance(t, gg.RemoteTensor)]
    try:
        if pointers:
            gg.compute(*pointers)
        return map_tensors(lambda t: t.get() if isinstance(t, gg.RemoteTensor) else t, obj)
    except Exception as e:
        raise SampleFailure("error", f"at .get(): {describe(e)}", summary(e)) from e


def spread(grid: gg.Grid, parts: tuple) -> tuple:
    """Send every tensor in `parts` to the grid, alternating w0, w1 (one message each)."""
    tensors = tensors_in(parts)
    by_worker: dict[int, list[int]] = {0: [], 1: []}
    for i in range(len(tensors)):
        by_worker[i % 2].append(i)
    pointers: dict[int, torch.Tensor] = {}
    try:
        for w, indices in by_worker.items():
            if indices:
                sent = grid.send_many([tensors[i] for i in indices], grid.workers[w])
                pointers.update(zip(indices, sent))
    except REFUSAL_ERRORS as e:
        raise SampleFailure("refusal", f"send: {type(e).__name__}: {first_line(e)}") from e
    except Exception as e:
        raise SampleFailure("error", f"send: {describe(e)}", summary(e)) from e
    counter = iter(range(len(tensors)))
    return map_tensors(lambda t: pointers[next(counter)], parts)


# --- structure ---------------------------------------------------------------------------


def map_tensors(fn, obj):
    """`obj` with `fn` applied to every tensor, through lists, tuples and dicts."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if type(obj) in (list, tuple):
        return type(obj)(map_tensors(fn, x) for x in obj)
    if isinstance(obj, tuple):  # torch.return_types (structseq), namedtuples, torch.Size
        items = [map_tensors(fn, x) for x in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if isinstance(obj, dict):
        return {k: map_tensors(fn, v) for k, v in obj.items()}
    return obj


def tensors_in(obj) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    map_tensors(out.append, obj)
    return out


def clone(t: torch.Tensor) -> torch.Tensor:
    c = t.detach().clone()
    return c.requires_grad_(t.requires_grad) if t.requires_grad else c


def as_sent(t: torch.Tensor) -> torch.Tensor:
    """A copy laid out as a worker holds a sent tensor: contiguous, in its own storage."""
    c = t.detach().contiguous().clone()
    return c.requires_grad_(t.requires_grad) if t.requires_grad else c


def compare(got, expected, where: str, op, uninitialised: bool = False) -> bool:
    """Raise SampleFailure("wrong") unless `got` matches `expected`; True when bit-equal,
    False when equal within the entry's tolerance for the dtype (`tolerance`)."""
    if isinstance(expected, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            wrong(f"{where}: expected a tensor, got {type(got).__name__}")
        if isinstance(got, gg.RemoteTensor):
            wrong(f"{where}: a pointer left after .get()")
        if got.dtype != expected.dtype or got.shape != expected.shape:
            got_is, want = (f"{t.dtype} {tuple(t.shape)}" for t in (got, expected))
            wrong(f"{where}: {got_is}, expected {want}")
        if uninitialised:
            return True
        got, expected = got.detach(), expected.detach()
        if got.is_conj() != expected.is_conj() or got.is_neg() != expected.is_neg():
            got, expected = got.resolve_conj().resolve_neg(), expected.resolve_conj().resolve_neg()
        try:
            torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)
            return True
        except AssertionError:
            pass
        try:
            rtol, atol = tolerance(op, expected.dtype)
            torch.testing.assert_close(got, expected, rtol=rtol, atol=atol, equal_nan=True)
        except AssertionError as e:
            wrong(f"{where}: values differ: {' '.join(str(e).split())[:200]}")
        return False
    if isinstance(expected, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(got) != len(expected):
            wrong(f"{where}: expected {len(expected)} items, got {got!r:.80}")
        pairs = [(f"{where}[{i}]", g, e) for i, (g, e) in enumerate(zip(got, expected))]
        return all([compare(g, e, at, op, uninitialised) for at, g, e in pairs])
    if isinstance(expected, dict):
        if not isinstance(got, dict) or got.keys() != expected.keys():
            wrong(f"{where}: expected a dict with keys {sorted(expected)}, got {got!r:.80}")
        pairs = [(f"{where}[{k!r}]", got[k], e) for k, e in expected.items()]
        return all([compare(g, e, at, op, uninitialised) for at, g, e in pairs])
    if isinstance(expected, float) and isinstance(got, float):
        if got == expected or (math.isnan(got) and math.isnan(expected)):
            return True
        if math.isclose(got, expected, rel_tol=1.3e-6, abs_tol=1e-5):
            return False
        wrong(f"{where}: {got!r}, expected {expected!r}")
    if type(got) is not type(expected) or got != expected:
        wrong(f"{where}: {got!r:.80}, expected {expected!r:.80}")
    return True


def tolerance(op, dtype: torch.dtype) -> tuple[float, float]:
    """(rtol, atol) for values that are not bit-equal: assert_close's defaults for the dtype,
    loosened to the loosest override the OpInfo entry declares for it on the CPU (its
    `toleranceOverride` / `precisionOverride` decorators; TestDecomp's, for instance, cover
    composite ops decomposed into ATen ops, which is what pointers record)."""
    rtol, atol = default_tolerances(dtype)
    for info in op.decorators:
        if not isinstance(info, DecorateInfo) or info.device_type not in (None, "cpu"):
            continue
        if info.dtypes is not None and dtype not in info.dtypes:
            continue
        for d in info.decorators:
            if isinstance(d, toleranceOverride) and dtype in d.d:
                rtol, atol = max(rtol, d.d[dtype].rtol), max(atol, d.d[dtype].atol)
            elif isinstance(d, precisionOverride) and dtype in d.d:
                atol = max(atol, d.d[dtype])
    return rtol, atol


def wrong(message: str):
    raise SampleFailure("wrong", message)


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__


def describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {first_line(e)}"


def summary(e: BaseException) -> list[str]:
    """The last frames of the traceback, for the failure list."""
    frames = traceback.extract_tb(e.__traceback__)[-4:]
    return [f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno} {f.name}" for f in frames]
