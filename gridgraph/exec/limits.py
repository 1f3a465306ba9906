"""Budgets a worker grants each client, and how a program is checked against them first.

A client is one session of one authenticated peer (see worker.py). Policy:

    memory      bytes a session holds on a worker: stored tensors, transfers waiting in its
                inbox, transfers kept for resending, cached replies and programs, request
                records. A request that would take the session over `max_client_memory` is
                refused before it changes anything; a program's new tensors are computed
                from meta shapes (PyTorch's shape-only device) before any step runs.
    time        a request runs at most `max_request_seconds`: a program estimated to need
                clearly more is refused before it runs; one that runs over is stopped at
                its next step (or killed with its executor process, see executor.py) and
                undone.
    messages    a message over `max_message_bytes` is dropped unread.
    rate        each peer may send `requests_per_second` requests, in bursts of up to
                `request_burst`; the rest are refused, naming the limit, at most as often
                (past that, dropped unanswered and unrecorded). A resend answered
                again and an ask to resend a kept transfer count too (past the rate they
                are ignored: the worker's sender thread is everyone's).
    sessions    each peer holds at most `sessions_per_peer` sessions on a worker; a new one
                evicts the peer's own least recently seen idle session. A session that a
                transfer opens counts against the transfer's sender until its client adopts
                it (worker.py).

Defaults: `Limits()` (what `gridgraph worker` uses) and `Limits.unlimited()` (what
`gg.local_grid` uses unless asked: an in-process grid serves only its own user).
"""

from __future__ import annotations

import math
import re
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

GiB = 1 << 30
MiB = 1 << 20

# Work (tensor elements touched, or multiply-adds of a matrix product) a worker is assumed to
# do per second at most. Generous on purpose: only a program clearly over the time limit is
# refused before it runs; the rest are stopped when they overrun.
WORK_PER_SECOND = 2e10
# Bytes charged for each request record a session keeps (its id, and the bookkeeping).
RECORD_BYTES = 200
# Bytes charged for each transfer an inbox keeps, beside its payload (its key, the bytes
# object, the dictionaries; measured ~370): tiny transfers held 4x what their payloads count.
TRANSFER_BYTES = 400


class LimitExceeded(Exception):
    """A request refused because it would break one of its client's limits."""

    code = "limit"


@dataclass(frozen=True)
class Limits:
    """Per-client budgets of a worker; None means unlimited."""

    max_client_memory: int | None = 4 * GiB
    max_request_seconds: float | None = 300.0
    max_message_bytes: int = 256 * MiB
    requests_per_second: float = 500.0
    request_burst: int = 2000
    sessions_per_peer: int = 64

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
    """A token bucket per peer: `rate` requests a second, bursts of up to `burst`."""

    def __init__(self, rate: float, burst: int) -> None:
        self.rate, self.burst = rate, burst
        self._buckets: dict[str, tuple[float, float]] = {}  # peer -> (tokens, updated)
        self._forget_past = 100_000  # peers tracked before the long-gone ones are forgotten
        self._lock = threading.Lock()

    def allow(self, peer: str) -> bool:
        """Take one token from `peer`'s bucket; False if it is empty."""
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
            ok = tokens >= 1
            self._buckets[peer] = (tokens - 1 if ok else tokens, now)
            return ok


# --- a program's footprint from meta shapes --------------------------------------------------


def meta_like(t: torch.Tensor) -> torch.Tensor:
    """A meta tensor with `t`'s shape, strides, storage offset and dtype."""
    storage = torch.empty(t.untyped_storage().nbytes() // t.dtype.itemsize or 0,
                          dtype=t.dtype, device="meta")  # fmt: skip
    return storage.as_strided(t.shape, t.stride(), t.storage_offset())


def op_footprint(op: Any, args: list, kwargs: dict) -> tuple[Any, dict[int, int], float] | None:
    """Run `op` on meta arguments: (meta result, new storages, work), or None.

    New storages are those of the result that no argument shares, as {storage key: bytes},
    and the growth of an argument's storage that the op resized in place (`resize_`).

    None when the op has no meta kernel (data-dependent ops such as nonzero: bounded from
    their real arguments by `data_dependent_footprint`) or the arguments do not fit (the
    real call will say so).
    """
    inputs: list[torch.Tensor] = []
    _tensors(args, inputs)
    _tensors(list(kwargs.values()), inputs)
    storages = {t.untyped_storage()._cdata: t.untyped_storage() for t in inputs}
    sizes = {key: storage.nbytes() for key, storage in storages.items()}
    try:
        with torch.no_grad():
            result = op(*args, **kwargs)
    except Exception:
        return None
    outputs: list[torch.Tensor] = []
    _tensors([result], outputs)
    shared = {t.untyped_storage()._cdata for t in inputs}
    new = {
        t.untyped_storage()._cdata: t.untyped_storage().nbytes()
        for t in outputs
        if t.untyped_storage()._cdata not in shared
    }
    for key, storage in storages.items():  # grown in place: the growth is new memory
        if storage.nbytes() > sizes[key]:
            new[key] = storage.nbytes() - sizes[key]
    biggest = max((t.numel() for t in inputs + outputs), default=0)
    work = float(biggest)
    name = op._schema.name
    if name in _PRODUCTS and inputs and outputs and inputs[-1].dim() >= 1:
        work = max(work, 2.0 * outputs[0].numel() * _inner_dim(name, inputs))
    return result, new, work


def data_dependent_footprint(op: Any, args: list, kwargs: dict) -> tuple[int, float]:
    """(new bytes, work) at most, of an op whose output size depends on its data (one
    `op_footprint` cannot tell), read from its real arguments before it runs.

    bincount (its largest value sets its length), repeat_interleave (its repeats), nonzero
    (an index per dimension for each element), histogram (its bin count) and ctc_loss (its
    steps times its targets) have bounds of their own. Any other (unique, masked_select, a
    boolean index) makes at most 32 bytes (a complex value, an index and a count) for each
    element of its largest argument, broadcast: elements, not storage bytes, as an expanded
    argument has many more. The work is an element of input or output each."""
    schema = op._schema

    def arg(name: str, default: Any = None) -> Any:
        for i, a in enumerate(schema.arguments):
            if a.name == name:
                return args[i] if i < len(args) else kwargs.get(name, default)
        return default

    tensors: list[torch.Tensor] = []
    _tensors(args, tensors)
    _tensors(list(kwargs.values()), tensors)
    try:
        elements = math.prod(torch.broadcast_shapes(*(t.shape for t in tensors)))
    except RuntimeError:  # (arguments that do not broadcast together)
        elements = max((t.numel() for t in tensors), default=0)
    made = _data_dependent_bytes(schema.name, arg, elements)
    return made, float(max(elements, made // 8))


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


_PRODUCTS = {"aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm", "aten::matmul",
             "aten::linear", "aten::addbmm", "aten::einsum"}  # fmt: skip


def _inner_dim(name: str, inputs: list[torch.Tensor]) -> int:
    if name == "aten::linear":
        return inputs[0].shape[-1] if inputs[0].dim() else 1
    if name in ("aten::addmm", "aten::baddbmm", "aten::addbmm") and len(inputs) >= 3:
        return inputs[-1].shape[-2] if inputs[-1].dim() >= 2 else 1
    return inputs[-1].shape[-2] if inputs[-1].dim() >= 2 else inputs[-1].shape[0]


def _tensors(obj: Any, out: list[torch.Tensor]) -> None:
    for a in obj:
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            _tensors(a, out)
