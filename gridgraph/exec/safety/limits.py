"""Budgets a worker grants each client, and how a program is checked against them first.

A client is one session of one authenticated peer (see worker/worker.py). `Limits` holds the
budgets (memory, time, message size, request rate, sessions per peer, executors); its
docstring says what each bounds and what happens past it. Policy: check before spending.
A request that would break a budget is refused, naming the limit, before it changes
anything: a program's new tensors are worked out from meta shapes (PyTorch's shape-only
device) before any step runs (`op_footprint`), the scratch each op takes while it runs is
bounded from its inputs (`op_scratch`), and its work from elements touched or multiply-adds
(`op_work`), so that one clearly over the time limit never starts.

State: none here but the per-peer counters of `RateLimiter`, which the worker owns (and
budget.py's `MemoryBudget`). Defaults: `Limits()` (what `gridgraph worker` uses) and
`Limits.unlimited()` (what `gg.local_grid` uses unless asked: an in-process grid serves only
its own user).
"""

from __future__ import annotations

import math
import os
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from gridgraph.exec.safety.arguments import argument_reader, stored_magnitude, tensors_in
from gridgraph.exec.safety.kernel_checks import check_enum_arguments
from gridgraph.trace.allowlist import CATEGORIES
from gridgraph.trace.meta import meta_tensor, run_on_meta
from gridgraph.trace.work import convolution_macs, inner_dim

GiB = 1 << 30
MiB = 1 << 20

# Work (tensor elements touched, or multiply-adds of a matrix product) a worker is assumed to
# do per second at most. Generous on purpose: only a program clearly over the time limit is
# refused before it runs; the rest are stopped when they overrun.
WORK_PER_SECOND = 2e10
# Bytes charged for each request record a session keeps (its id, and the bookkeeping).
RECORD_BYTES = 200
# Bytes charged for each transfer an inbox keeps, beside its payload (its key, the bytes
# object's header, the dictionaries and sets that hold it, whose tables double as they grow;
# measured with tracemalloc at 430-540 per 132-byte transfer, up to 670 in a loaded run):
# tiny transfers held 4x what their payloads count.
TRANSFER_BYTES = 600


# `gridgraph worker` caps its network process at this part of the machine's memory, unless
# told otherwise (max_worker_memory).
MACHINE_PART = 4


def machine_memory() -> int:
    """Bytes of physical memory of this machine."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class LimitExceeded(Exception):
    """A request refused because it would break one of its client's limits."""

    code = "limit"


@dataclass(frozen=True)
class Limits:
    """Per-client budgets of a worker; None means unlimited.

    max_client_memory    bytes a session holds on a worker: stored tensors, transfers
                         waiting in its inbox or kept for resending, cached replies and
                         programs, request records. Past it a request is refused before it
                         changes anything; scratch counts at an op's peak, not after it.
    max_request_seconds  a request runs at most this long: a program estimated to need
                         clearly more is refused before it runs; one that runs over is
                         stopped at its next step (or killed with its executor process,
                         isolation/executor.py) and undone.
    max_message_bytes    a larger message is dropped unread.
    requests_per_second, request_burst  per peer; the rest are refused, naming the limit,
                         at most as often (past that, dropped unanswered and unrecorded). A
                         resend answered again and an ask to resend a transfer count too.
    sessions_per_peer    a new session past it evicts the peer's own least recently seen
                         idle one; a session a transfer opens counts against the
                         transfer's sender until its client adopts it. A quarter of
                         `max_executors`, so no one peer holds every executor place.
    max_executors        executor processes at once (each holds some 15 MB), each peer
                         a fair share of them (budget.fair_share): a session past it
                         takes the place of an idle one that stores nothing (its executor
                         starts again on its next request), else is refused until one ends.
    max_worker_memory    bytes the network process holds for all peers at once (requests
                         waiting to run, their records, transfers no run named, payloads
                         being fetched), each peer at most a 1/`peer_shares` of it
                         (budget.py); past either, what would be kept is refused. Default:
                         a MACHINE_PART of the machine's memory.
    """

    max_client_memory: int | None = 4 * GiB
    max_request_seconds: float | None = 300.0
    max_message_bytes: int = 256 * MiB
    requests_per_second: float = 500.0
    request_burst: int = 2000
    sessions_per_peer: int = 16
    max_executors: int = 64
    max_worker_memory: int | None = field(default_factory=lambda: machine_memory() // MACHINE_PART)
    peer_shares: int = 16

    @classmethod
    def unlimited(cls) -> Limits:
        """No budgets beyond what the transport imposes: for a grid that serves one user."""
        return cls(
            max_client_memory=None,
            max_request_seconds=None,
            max_message_bytes=1 << 62,
            requests_per_second=math.inf,
            request_burst=1 << 62,
            sessions_per_peer=1 << 30,
            max_executors=1 << 30,
            max_worker_memory=None,
        )

    def check_memory(self, needed: int, what: str) -> None:
        """Raise LimitExceeded if a session would hold `needed` bytes."""
        cap = self.max_client_memory
        if cap is not None and needed > cap:
            raise LimitExceeded(
                f"{what} needs {format_size(needed)} on this worker, over the client's memory "
                f"limit of {format_size(cap)} (max_client_memory)"
            )

    def check_work(self, work: float, what: str) -> None:
        """Raise LimitExceeded if `work` clearly cannot finish within the time limit."""
        cap = self.max_request_seconds
        if cap is not None and work > cap * WORK_PER_SECOND:
            raise LimitExceeded(
                f"{what} would run for about {work / WORK_PER_SECOND:.0f} s, over the request "
                f"time limit of {cap:g} s (max_request_seconds)"
            )

    def deadline(self, start: float) -> float:
        """The monotonic time by which a request started at `start` must finish."""
        cap = self.max_request_seconds
        return math.inf if cap is None else start + cap


class TimeLimitExceeded(Exception):
    """A request ran past its time limit and was stopped."""

    code = "limit"

    def __init__(self, seconds: float | None) -> None:
        super().__init__(
            f"the request ran past the time limit of {seconds:g} s of this worker "
            "(max_request_seconds) and was stopped; what it stored was undone"
        )


# --- sizes -----------------------------------------------------------------------------------

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "m": 10**6, "mb": 10**6,
          "mib": 1 << 20, "g": 10**9, "gb": 10**9, "gib": 1 << 30, "t": 10**12,
          "tb": 10**12, "tib": 1 << 40}  # fmt: skip


def parse_size(text: str) -> int:
    """Bytes from a size such as `1GiB`, `512MiB`, `2e9` or `1.5GB`.

    >>> parse_size("1GiB")
    1073741824
    """
    m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = _UNITS.get(m.group(2).lower()) if m else None
    if unit is None:
        raise ValueError(f"not a size: {text!r} (examples: 1GiB, 512MiB, 2e9)")
    return int(float(m.group(1)) * unit)


def format_size(n: int) -> str:
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} bytes"


# --- requests per second ---------------------------------------------------------------------


class RateLimiter:
    """A token bucket per peer: `rate` requests (or bytes, ...: each `allow` says how many
    it takes) a second, bursts of up to `burst`."""

    def __init__(self, rate: float, burst: int) -> None:
        self.rate, self.burst = rate, burst
        self._buckets: dict[str, tuple[float, float]] = {}  # peer -> (tokens, updated)
        self._forget_past = 100_000  # peers tracked before the long-gone ones are forgotten
        self._lock = threading.Lock()

    def allow(self, peer: str, cost: float = 1.0) -> bool:
        """Take `cost` tokens from `peer`'s bucket; False (taking none) if it has fewer."""
        if math.isinf(self.rate):
            return True
        now = time.monotonic()
        with self._lock:
            tokens, updated = self._buckets.get(peer, (self.burst, now))
            tokens = min(self.burst, tokens + (now - updated) * self.rate)
            if len(self._buckets) > self._forget_past:
                # Peers long gone: forget the buckets refilled since they were last used
                # (judged by their tokens then, a peer that sent one request stayed forever)
                self._buckets = {
                    p: b
                    for p, b in self._buckets.items()
                    if b[0] + (now - b[1]) * self.rate < self.burst
                }
                # rebuilt again once the table has doubled, not on every request
                self._forget_past = max(100_000, 2 * len(self._buckets))
            ok = tokens >= cost
            self._buckets[peer] = (tokens - cost if ok else tokens, now)
            return ok

    def charge(self, peer: str, cost: float) -> None:
        """Take `cost` more tokens from `peer`'s bucket, below zero if need be: it waits
        until the bucket refills past one again."""
        if math.isinf(self.rate):
            return
        now = time.monotonic()
        with self._lock:
            tokens, updated = self._buckets.get(peer, (self.burst, now))
            tokens = min(self.burst, tokens + (now - updated) * self.rate)
            self._buckets[peer] = (tokens - cost, now)


# --- a program's footprint from meta shapes --------------------------------------------------


def meta_like(t: torch.Tensor) -> torch.Tensor:
    """A meta tensor with `t`'s shape, strides, storage offset and dtype, on a storage of
    `t`'s storage's size (what a resize grows, and a view may reach, is measured from it)."""
    elements = t.untyped_storage().nbytes() // t.dtype.itemsize
    return meta_tensor(t.shape, t.stride(), t.storage_offset(), t.dtype, elements)


# What a meta kernel says when the meta device cannot tell, rather than that the arguments are
# wrong: it has no meta kernel (NotImplementedError), it read a value (`.item()`), or an
# argument was a constant CPU tensor.
_ABOUT_META = re.compile(r"meta tensor|meta kernel|meta backend|device meta", re.IGNORECASE)


def op_footprint(
    op: Any, args: list, kwargs: dict
) -> tuple[Any, dict[int, int], int, float] | None:
    """Run `op` on meta arguments: (meta result, new storages, scratch bytes, work), or None.

    New storages are those of the result that no argument shares, as {storage key: bytes},
    and the growth of an argument's storage that the op resized in place (`resize_`).
    Scratch is what the op may allocate inside itself and free before it returns
    (`op_scratch`): meta kernels allocate only results, so it is bounded from the arguments.

    None when the op has no meta kernel (data-dependent ops such as nonzero: bounded from
    their real arguments by `data_dependent_footprint`), its meta kernel cannot tell (it
    reads values), or its work depends on its data (`_WORK_FROM_DATA`).

    Raises what the meta kernel raised when it refuses the arguments: the call is refused
    and its real kernel never runs. A meta kernel checks what the CPU kernel checks, often
    more; CPU kernels that took what their meta kernels refused have read and written past
    their tensors, or allocated 17 GB of output charged as nothing (a convolution's
    output_padding of 2**32, which its meta kernel refused as too large).
    """
    check_enum_arguments(op, args, kwargs)
    if op._schema.name in _WORK_FROM_DATA:
        return None
    # A factory's device would make its result for real (new_zeros of 8 GiB "on meta" took
    # 20 s and the memory): on meta, as its inputs are.
    kwargs = {k: "meta" if k == "device" and v is not None else v for k, v in kwargs.items()}
    inputs = tensors_in(args, kwargs)
    storages = {t.untyped_storage()._cdata: t.untyped_storage() for t in inputs}
    sizes = {key: storage.nbytes() for key, storage in storages.items()}
    try:
        with torch.no_grad():
            result = run_on_meta(op, args, kwargs)
    except Exception as e:
        if isinstance(e, NotImplementedError) or _ABOUT_META.search(str(e)):
            return None
        raise
    outputs = tensors_in(result)
    shared = {t.untyped_storage()._cdata for t in inputs}
    new = {
        t.untyped_storage()._cdata: t.untyped_storage().nbytes()
        for t in outputs
        if t.untyped_storage()._cdata not in shared
    }
    for key, storage in storages.items():  # grown in place: the growth is new memory
        if storage.nbytes() > sizes[key]:
            new[key] = storage.nbytes() - sizes[key]
    arg = argument_reader(op, args, kwargs)
    return result, new, op_scratch(op, inputs, outputs, arg), op_work(op, inputs, outputs, arg)


def data_dependent_footprint(op: Any, args: list, kwargs: dict) -> tuple[int, float]:
    """(new bytes and scratch, work) at most, of an op whose output size depends on its
    data (one `op_footprint` cannot tell), read from its real arguments before it runs.

    bincount (its largest value sets its length), repeat_interleave (its repeats), nonzero
    (an index per dimension for each element), histogram (its bin count) and ctc_loss (its
    steps times its targets) have bounds of their own. Any other (unique, masked_select, a
    boolean index) makes at most 32 bytes (a complex value, an index and a count) for each
    element of its largest argument, broadcast: elements, not storage bytes, as an expanded
    argument has many more. The work is an element of input or output each."""
    tensors = tensors_in(args, kwargs)
    try:
        elements = math.prod(torch.broadcast_shapes(*(t.shape for t in tensors)))
    except RuntimeError:  # (arguments that do not broadcast together)
        elements = max((t.numel() for t in tensors), default=0)
    arg = argument_reader(op, args, kwargs)
    made = _data_dependent_bytes(op._schema.name, arg, elements)
    work = max(elements, made // 8, op_work(op, tensors, [], arg))  # (lstsq, geqrf: n^3)
    return made + op_scratch(op, tensors, [], arg), float(work)


def _data_dependent_bytes(name: str, arg: Any, elements: int) -> int:
    if name == "aten::bincount":
        values = arg("self")
        longest = int(values.max()) + 1 if values.numel() else 0
        return 8 * max(longest, int(arg("minlength", 0) or 0))
    if name == "aten::repeat_interleave":
        repeats = arg("repeats")  # (and the op's own running sum of them)
        most = max(0, int(repeats.max())) if repeats.numel() else 0
        return 8 * repeats.numel() * (1 + most)
    if name == "aten::nonzero":
        t = arg("self")
        return 8 * t.numel() * max(1, t.dim())
    if name == "aten::histogram" and isinstance(arg("bins"), int):
        return 16 * (arg("bins") + 1)
    if name == "aten::_ctc_loss":
        log_probs, targets = arg("log_probs"), arg("targets")
        steps = log_probs.shape[0] if log_probs.dim() else 1
        batch = log_probs.shape[1] if log_probs.dim() == 3 else 1
        longest = targets.shape[-1] if targets.dim() == 2 else targets.numel()
        return 16 * steps * batch * (2 * longest + 1) + 32 * elements
    return 32 * elements


# --- scratch: what an op allocates inside itself -------------------------------------------


def _schema_names(category: str) -> frozenset[str]:
    return frozenset("aten::" + name.split(".")[0] for name in CATEGORIES[category])


# Ops that compute nothing: a view or a new layout of their input's storage.
_LAYOUTS = _schema_names("views") | _schema_names("layout in place")
# Ops that sort or select: each may copy its input's values and an int64 index per element.
_SORTS = frozenset({"aten::sort", "aten::topk", "aten::kthvalue", "aten::median",
                    "aten::nanmedian", "aten::mode", "aten::isin", "aten::_unique",
                    "aten::_unique2", "aten::unique_consecutive", "aten::unique_dim"})  # fmt: skip
_CONVOLUTIONS = frozenset({"aten::convolution", "aten::convolution_backward"})
# Reductions that copy their input first (measured; the others read it where it lies), in
# int64 for count_nonzero.
_COPYING_REDUCTIONS = frozenset({"aten::aminmax", "aten::count_nonzero", "aten::logsumexp",
                                 "aten::max", "aten::min"})  # fmt: skip
# Reductions: torch tags them `reduction` from 2.7 on; named here so that the estimate is the
# same on every torch the package supports.
_REDUCTIONS = frozenset({"aten::" + name for name in (
    "all", "amax", "amin", "aminmax", "any", "argmax", "argmin", "count_nonzero",
    "linalg_vector_norm", "logsumexp", "max", "mean", "min", "nansum", "norm", "prod", "std",
    "std_mean", "sum", "var", "var_mean")})  # fmt: skip
_MVLGAMMA = frozenset({"aten::mvlgamma", "aten::mvlgamma_"})
_FFTS = frozenset({"aten::_fft_r2c", "aten::_fft_c2c", "aten::_fft_c2r"})
FFT_WORK = 200.0  # per element and halving (n log2 n; a prime length: 92-187 ns an element)


def op_scratch(op: Any, inputs: list[torch.Tensor], outputs: list[torch.Tensor], arg: Any) -> int:
    """Bytes `op` may allocate inside itself and free before it returns, at most.

    Meta kernels never show these, and they are not bounded by what a client holds: an
    expanded input holds one number and reads as billions, which a kernel copies to a
    contiguous buffer or sorts. So inputs are charged by their logical size (elements, not
    storage), at the widest dtype involved, as measured on CPU kernels:
        pointwise ops, views and     only a copy of each input not in the dtype it computes
        most reductions              in (TensorIterator casts a copy; it reads strides as
                                     they are)
        a few reductions             one copy, in int64 at least (max, min, aminmax,
                                     logsumexp, count_nonzero)
        mvlgamma(x, p)               p terms for each element of x (a 4-byte x and p = 1e8
                                     held 760 MB, charged 4 bytes)
        sorting and selection        2 copies and an int64 index per element (isin sorts a
                                     copy of both inputs; topk, mode: 16 B per float)
        any other op                 one contiguous copy of each input, and more where it
                                     broadcasts them (losses over their broadcast shape,
                                     solvers over their broadcast batch), unfolds them (a
                                     convolution's columns, `_trilinear`'s outer product) or
                                     counts rows (embedding backward, scale_grad_by_freq;
                                     an embedding bag's backward always, 16 B a row),
                                     pads them (oneDNN's convolutions: channels to 16)
                                     or transforms them (an FFT: 12 values per element)
    """
    name = op._schema.name
    width = max((t.element_size() for t in inputs + outputs), default=1)
    if name in _MVLGAMMA:  # p terms per element, and a range of p (they sum to the result)
        p, elements = max(0, int(arg("p"))), sum(t.numel() for t in inputs)
        return p * (1 + elements) * width + elements
    if name in _COPYING_REDUCTIONS:
        return sum(t.numel() * max(8, width) for t in inputs)
    if name in _LAYOUTS or torch.Tag.pointwise in op.tags or name in _REDUCTIONS:
        return _casts(inputs, outputs, width)
    if name in _SORTS:
        return sum(t.numel() * (2 * width + 16) for t in inputs)
    scratch = sum(t.numel() * width for t in inputs)
    if name in _CONVOLUTIONS and _unfolds_columns(arg):
        columns = _convolution_macs(arg("input"), arg("weight"), outputs, arg)
        scratch += columns // max(1, arg("weight").shape[0]) * int(arg("groups")) * width
    elif name in _CONVOLUTIONS:  # oneDNN's copy in its blocked layout, the largest (measured)
        weight = arg("weight")
        scratch += max(_blocked_elements(t, weight) for t in inputs + outputs) * width
    elif name in _BROADCAST_LOSSES:
        scratch += 2 * _broadcast_elements(inputs) * width
    elif name in _BATCH_BROADCASTS:
        scratch += _batch_broadcast_elements(inputs) * width
    elif name == "aten::_trilinear":
        scratch += 2 * _trilinear_elements(arg) * width
    elif name in _FFTS:  # a prime length takes Bluestein's: 58-76 B per float32 element
        scratch += 12 * width * max(t.numel() for t in inputs + outputs)
    rows = arg("num_weights")
    if isinstance(rows, int) and name == "aten::_embedding_bag_backward":
        scratch += 16 * max(0, rows)  # a count and a unique count per row, always
    elif isinstance(rows, int) and arg("scale_grad_by_freq"):
        scratch += 8 * max(0, rows)  # a count per row
    return scratch


def _casts(inputs: list[torch.Tensor], outputs: list[torch.Tensor], width: int) -> int:
    """Bytes of the copies made of inputs not in the dtype the op computes in: its result's
    (a reduction's dtype= too), or its inputs' common one where it returns bools."""
    if not inputs:
        return 0
    common = inputs[0].dtype
    for t in inputs[1:]:
        common = torch.promote_types(common, t.dtype)
    computes = outputs[0].dtype if outputs and outputs[0].dtype != torch.bool else common
    return sum(t.numel() * width for t in inputs if t.dtype != computes)


def _broadcast_elements(inputs: list[torch.Tensor]) -> int:
    try:
        return math.prod(torch.broadcast_shapes(*(t.shape for t in inputs)))
    except RuntimeError:  # (the op will refuse them)
        return 0


def _batch_broadcast_elements(inputs: list[torch.Tensor]) -> int:
    """Elements of the inputs' matrices copied out to their broadcast batch shape."""
    matrices = [t for t in inputs if t.dim() >= 2]
    try:
        batch = math.prod(torch.broadcast_shapes(*(t.shape[:-2] for t in matrices)))
    except RuntimeError:
        return 0
    return sum(batch * t.shape[-2] * t.shape[-1] for t in matrices)


def _trilinear_elements(arg: Any) -> int:
    """Elements of `_trilinear`'s product of its three inputs, each unsqueezed where its
    expand argument says, before it sums: an outer product of inputs that hold one number."""
    shapes = []
    for t, dims in ((arg("i1"), arg("expand1")), (arg("i2"), arg("expand2")),
                    (arg("i3"), arg("expand3"))):  # fmt: skip
        shape = list(t.shape)
        for d in sorted(dims):
            shape.insert(min(max(d, 0), len(shape)), 1)
        shapes.append(shape)
    try:
        return math.prod(torch.broadcast_shapes(*shapes))
    except RuntimeError:
        return 0


# The CPU convolution kernels that unfold their input into columns (im2col); the others
# (oneDNN's) copy each tensor into a blocked layout instead.
_COLUMN_BACKENDS = frozenset({"Slow2d", "Slow3d", "SlowDilated2d", "SlowDilated3d",
                              "SlowTranspose2d", "SlowTranspose3d"})  # fmt: skip
BLOCK = 16  # oneDNN pads a blocked layout's channels to a multiple of 16 (8 without AVX-512)


def _unfolds_columns(arg: Any) -> bool:
    """Whether a convolution's kernel unfolds its input into columns: torch's own choice of
    kernel, asked of stand-ins with the arguments' shapes and dtypes that hold one number
    (it depends on the dtype, the sizes and the number of spatial dimensions: a float32
    3-D convolution of one channel unfolds, one of 16 does not)."""
    input, weight = arg("input"), arg("weight")

    def stand_in(t: torch.Tensor) -> torch.Tensor:
        return torch.zeros((), dtype=t.dtype).expand(t.shape)

    try:
        backend = torch._C._select_conv_backend(
            stand_in(input), stand_in(weight), None, arg("stride"), arg("padding"),
            arg("dilation"), arg("transposed"), arg("output_padding"), arg("groups"),
        )  # fmt: skip
    except (RuntimeError, TypeError, AttributeError):  # (the op will refuse them)
        return True
    return backend.name in _COLUMN_BACKENDS


def _blocked_elements(t: torch.Tensor, weight: torch.Tensor) -> int:
    """Elements of `t` in oneDNN's blocked layout: its channels (a weight's output and input
    channels) padded to a multiple of BLOCK. A 1-channel image takes 16 times its size."""
    if t.dim() < 3:
        return t.numel()
    padded = list(t.shape)
    channels = (0, 1) if t.shape == weight.shape else (1 if t.dim() == weight.dim() else 0,)
    for d in channels:
        padded[d] = -(-padded[d] // BLOCK) * BLOCK
    return math.prod(padded)


def _convolution_macs(input: torch.Tensor, weight: torch.Tensor, outputs: list, arg: Any) -> int:
    """Multiply-adds of a convolution (`work.convolution_macs`) or of its backward: over its
    output, or the gradient of it; 0 where a tensor it needs is missing."""
    output = arg("grad_output")
    if output is None and outputs:
        output = outputs[0]
    if not all(isinstance(t, torch.Tensor) for t in (input, weight, output)):
        return 0
    return convolution_macs(input.shape, weight.shape, output.shape, arg("transposed"))


_BROADCAST_LOSSES = frozenset({"aten::mse_loss", "aten::huber_loss", "aten::smooth_l1_loss",
                               "aten::soft_margin_loss", "aten::binary_cross_entropy",
                               "aten::binary_cross_entropy_with_logits", "aten::dist"})  # fmt: skip
_BATCH_BROADCASTS = frozenset({"aten::cholesky_solve", "aten::linalg_solve_triangular",
                               "aten::_linalg_solve_ex", "aten::linalg_lu_solve",
                               "aten::linalg_ldl_solve", "aten::triangular_solve",
                               "aten::linalg_lstsq", "aten::_cdist_forward",
                               "aten::_cdist_backward"})  # fmt: skip


# --- work: how long an op runs ---------------------------------------------------------------

# Polynomials whose kernels loop as many times as the degree `n` they are given, for each
# element, at some points (one element of degree 4e9 ran for 20 s): charged
# POLYNOMIAL_STEP_WORK a step, from `n`'s values, so bounded from the real arguments before
# they run. (Hermite's give up past a degree of their own.)
_POLYNOMIALS = frozenset(
    {"aten::special_laguerre_polynomial_l", "aten::special_legendre_polynomial_p"}
    | {f"aten::special_{shifted}chebyshev_polynomial_{kind}" for shifted in ("", "shifted_")
       for kind in "tuvw"}
)  # fmt: skip
POLYNOMIAL_STEP_WORK = 100.0  # a step of the recurrence, 1.2-5 ns (measured), in work units
# matrix_exp squares its scaled matrix once per doubling of its norm: from its values.
_MATRIX_EXP = "aten::linalg_matrix_exp"
_WORK_FROM_DATA = _POLYNOMIALS | {_MATRIX_EXP}
_ATTENTION = frozenset({"aten::_scaled_dot_product_flash_attention_for_cpu",
                        "aten::_scaled_dot_product_flash_attention_for_cpu_backward"})  # fmt: skip
ATTENTION_SCORE_WORK = 200.0  # a query-key score: its softmax and blocking (~8 ns measured)
LGAMMA_WORK = 400.0  # an lgamma (~18 ns measured)
RENORM_ROW_WORK = 4e4  # embedding_renorm_: a norm op per distinct index (~2 us measured)
_PRODUCTS = {"aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm", "aten::matmul",
             "aten::linear", "aten::addbmm", "aten::einsum"}  # fmt: skip
# Ops whose every output element takes a pass over the last dimension of its input.
_DISTANCES = {"aten::_cdist_forward", "aten::_cdist_backward", "aten::_pdist_forward",
              "aten::_pdist_backward", "aten::_euclidean_dist"}  # fmt: skip


def op_work(op: Any, inputs: list[torch.Tensor], outputs: list[torch.Tensor], arg: Any) -> float:
    """Work of `op`: elements touched, or multiply-adds where it does more than a pass.

    Matrix products and convolutions count their multiply-adds (a convolution's backward
    twice: its input's gradient and its weight's), pools a window's elements per output,
    distances and margin losses their output times the vectors' length, embedding bags a
    row per index, embedding_renorm_ a norm op per index, factorisations and solvers n^3
    per matrix, sorts n log n, searches log n per element, ops that broadcast their inputs
    the broadcast elements, mvlgamma its p terms per element, the polynomials of
    `_POLYNOMIALS` their degree per element, FFTs n log n (a prime length's constant),
    matrix_exp n^3 per squaring (its values set how many), attention its queries times its
    keys, and an RNN layer its steps times its weights."""
    biggest = max((t.numel() for t in inputs + outputs), default=0)
    work = float(biggest)
    name = op._schema.name
    if not inputs:
        return work
    if name in _PRODUCTS and outputs and inputs[-1].dim() >= 1:
        inner = inner_dim(name, [t.shape for t in inputs])
        return max(work, 2.0 * outputs[0].numel() * inner)
    if name in _CONVOLUTIONS:
        times = 4.0 if name == "aten::convolution_backward" else 2.0
        return max(work, times * _convolution_macs(arg("input"), arg("weight"), outputs, arg))
    if "pool" in name and outputs:  # per pooled element (a backward's: its gradient's)
        pooled = arg("grad_output") if arg("grad_output") is not None else outputs[0]
        return max(work, 2.0 * pooled.numel() * _pool_window(name, arg))
    if name in _DISTANCES or name.startswith("aten::multilabel_margin_loss"):
        vectors = arg("self") if arg("self") is not None else arg("x1")  # (not the gradient)
        return max(work, 2.0 * biggest * (vectors.shape[-1] if vectors.dim() else 1))
    if name == "aten::embedding_renorm_":
        indices = arg("indices")
        return max(work, RENORM_ROW_WORK * indices.numel() if indices is not None else 0.0)
    if name.startswith("aten::_embedding_bag"):
        weight, indices = arg("weight"), arg("indices")
        row = weight.shape[-1] if isinstance(weight, torch.Tensor) and weight.dim() else 1
        return max(work, 2.0 * indices.numel() * row if indices is not None else 0.0)
    if name == _MATRIX_EXP:
        return max(work, 2.0 * _cubed(inputs[0]) * (_squarings(inputs[0]) + 12))
    if name.startswith(("aten::linalg_", "aten::_linalg_")) or name in _FACTORISATIONS:
        return max(work, max(_cubed(t) for t in inputs))
    if name in _SORTS:
        return max(work, biggest * math.log2(max(2, biggest)))
    if name in _SEARCHES:  # a binary search of the sequence's last dimension per element
        sequence = arg("boundaries") if arg("boundaries") is not None else arg("sorted_sequence")
        length = sequence.shape[-1] if sequence.dim() else 1
        return max(work, biggest * math.log2(max(2, length)))
    if name in _FFTS:
        return max(work, FFT_WORK * biggest * math.log2(max(2, biggest)))
    if name == "aten::_trilinear":
        return max(work, 2.0 * _trilinear_elements(arg))
    if name in _POLYNOMIALS:
        steps = _largest_degree(arg("n"))
        return max(work, POLYNOMIAL_STEP_WORK * steps * max(1, _broadcast_elements(inputs)))
    if name in _MVLGAMMA:
        return max(work, LGAMMA_WORK * max(0, int(arg("p"))) * biggest)
    if name in _ATTENTION:  # every query against every key, over both vectors' lengths
        query, key, value = arg("query"), arg("key"), arg("value")
        scores = query.numel() // max(1, query.shape[-1]) * key.shape[-2]
        length = query.shape[-1] + value.shape[-1]
        return max(work, scores * (2.0 * length + ATTENTION_SCORE_WORK))
    if name.startswith("aten::mkldnn_rnn_layer"):  # each step: its gates' matrix products
        steps = arg("input").numel() // max(1, arg("input").shape[-1])  # x batch
        weights = sum(t.numel() for t in inputs if t.dim() == 2)
        return max(work, 4.0 * steps * weights)
    return max(work, float(_broadcast_elements(inputs)) if name in _BROADCAST_LOSSES else 0.0)


def _pool_window(name: str, arg: Any) -> int:
    """Input elements a pool reads for each output element: its kernel's (one number is the
    size in every spatial dimension: `[64]` reads 64 x 64 in 2-D), or an adaptive pool's
    widest window, ceil(in / out) + 1 in each dimension."""
    spatial = 3 if "3d" in name else 2
    kernel = arg("kernel_size")
    if kernel is not None:
        sizes = [kernel] if isinstance(kernel, int) else list(kernel)
        return math.prod(max(0, int(k)) for k in (sizes * spatial if len(sizes) == 1 else sizes))
    if "adaptive" not in name:  # (max_unpool: an element each)
        return 1
    input, out = arg("self"), arg("output_size")
    if out is None:  # (a backward: its gradient is shaped as the output)
        out = arg("grad_output").shape[-spatial:]
    return math.prod(-(-int(i) // max(1, int(o))) + 1
                     for i, o in zip(input.shape[-spatial:], out))  # fmt: skip


_SEARCHES = frozenset({"aten::searchsorted", "aten::bucketize"})
_FACTORISATIONS = {"aten::cholesky_inverse", "aten::cholesky_solve", "aten::geqrf",
                   "aten::ormqr", "aten::triangular_solve", "aten::lu_unpack"}  # fmt: skip


def _cubed(t: torch.Tensor) -> float:
    """n^3 for each n x n matrix of a batch of them (m n^2 for n x m ones, n <= m)."""
    if t.dim() < 2:
        return float(t.numel())
    n, m = sorted(t.shape[-2:])
    return float(math.prod(t.shape[:-2])) * m * n * n


def _squarings(t: torch.Tensor) -> float:
    """How often matrix_exp squares `t`: log2 of its 1-norm (at most n times its largest
    entry), 1,100 at most (past float64's range)."""
    if not t.numel():
        return 0.0
    most = stored_magnitude(t) * t.shape[-1]
    if not math.isfinite(most):
        return 1100.0
    return min(1100.0, max(0.0, math.log2(most + 1)))


def _largest_degree(n: Any) -> float:
    """The largest degree in `n` (a tensor or a number): a kernel's loop count. The kernels
    cast it to int64 (so past 2^63 it is charged as 2^63)."""
    if isinstance(n, torch.Tensor):
        if n.dtype == torch.bool or not n.numel():
            return float(n.numel() > 0)
        n = stored_magnitude(n)
    n = abs(float(n))
    return 0.0 if math.isnan(n) else min(n, 2.0**63)
