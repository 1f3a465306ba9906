"""Which ATen ops a worker will run, and how it runs one call.

A worker resolves an op by name (`aten::add.Tensor`) in the `aten` namespace only, after
checking the name's shape, and refuses the few ATen ops that reach outside tensor math
(files, raw storages, process state). Random ops draw from the worker's own generator, so
`worker.manual_seed(s)` makes them repeatable without touching anyone else's random state.
"""

from __future__ import annotations

import re
import threading
from functools import cache
from typing import Any

import torch

_NAME = re.compile(r"^aten::([a-z_][a-z0-9_]*)(?:\.([a-zA-Z0-9_]+))?$")

# ATen ops that touch files, raw memory or global state rather than tensor values.
DENIED = frozenset({
    "from_file", "set_", "_set_", "data_ptr", "_cpu_cuda_kernel", "save", "load",
    "_nested_tensor_from_mask", "_pin_memory", "pin_memory", "record_stream",
    "_make_per_tensor_quantized_tensor", "_foobar", "_assert_async", "_print",
    "lift_fresh", "_fused_sdp_choice",
})  # fmt: skip
# "_unsafe" ops skip bounds checks; _unsafe_view only skips autograd's view tracking.
ALLOWED_UNSAFE = frozenset({"_unsafe_view"})


class OpRefused(ValueError):
    """An op name a worker will not run."""


class ViewOutOfBounds(OpRefused):
    """An op returned a tensor whose elements reach outside its storage."""


def check_view(result: Any) -> None:
    """Refuse any tensor in `result` (a tensor, or a tuple/list of them) that reaches outside
    its storage: every element addressed by (sizes, strides, storage_offset) must lie inside
    the storage's bytes, and no stride or offset may be negative.

    The worker calls this after every op, before the result is stored or used: a view built
    without a bounds check (`_reshape_alias` did this) would read or write memory that is
    not the tensor's, such as another client's tensor.
    """
    if isinstance(result, torch.Tensor):
        _check_bounds(result)
    elif isinstance(result, (tuple, list)):
        for r in result:
            if isinstance(r, torch.Tensor):
                _check_bounds(r)


def _check_bounds(t: torch.Tensor) -> None:
    if t.layout != torch.strided or t.device.type != "cpu":
        raise ViewOutOfBounds(f"an op returned a {t.layout} tensor on {t.device}: not allowed")
    offset, sizes, strides = t.storage_offset(), t.shape, t.stride()
    if offset < 0 or any(s < 0 for s in strides):
        raise ViewOutOfBounds(
            f"an op returned a view with negative strides {tuple(strides)} or offset {offset}"
        )
    if t.numel() == 0:
        return
    last = offset + sum((n - 1) * s for n, s in zip(sizes, strides))
    need = (last + 1) * t.element_size()
    have = t.untyped_storage().nbytes()
    if need > have:
        raise ViewOutOfBounds(
            f"an op returned a view of sizes {tuple(sizes)}, strides {tuple(strides)} and "
            f"offset {offset} that needs {need} bytes of a storage of {have}"
        )


@cache
def resolve(name: str) -> torch._ops.OpOverload:
    """The ATen overload called `name`, if it is on the allowlist."""
    m = _NAME.match(name) if isinstance(name, str) else None
    if m is None:
        raise OpRefused(f"{name!r} is not an ATen op name")
    base, overload = m.group(1), m.group(2) or "default"
    if base in DENIED or (base.startswith("_unsafe") and base not in ALLOWED_UNSAFE):
        raise OpRefused(f"aten::{base} is not allowed on workers")
    try:
        op = getattr(getattr(torch.ops.aten, base), overload)
    except (AttributeError, RuntimeError):
        raise OpRefused(f"unknown ATen op {name!r}") from None
    if not isinstance(op, torch._ops.OpOverload):
        raise OpRefused(f"{name!r} is not an op overload")
    return op


@cache
def _seeded(op: torch._ops.OpOverload) -> bool:
    return torch.Tag.nondeterministic_seeded in op.tags


# Seeded ops that take no generator argument (dropout) draw from torch's global generator:
# swapping each worker's state in and out must not interleave between worker threads.
_global_rng = threading.Lock()


class RandomState:
    """A worker's own random stream."""

    def __init__(self) -> None:
        self.state = torch.Generator().get_state()

    def manual_seed(self, seed: int) -> None:
        self.state = torch.Generator().manual_seed(seed).get_state()

    def call(self, op: torch._ops.OpOverload, args: list, kwargs: dict):
        if not _seeded(op):
            return op(*args, **kwargs)
        with _global_rng:
            saved = torch.get_rng_state()
            torch.set_rng_state(self.state)
            try:
                return op(*args, **kwargs)
            finally:
                self.state = torch.get_rng_state()
                torch.set_rng_state(saved)
