"""Which ATen ops a worker will run, and how it runs one call.

Threat model: any peer may name any op with any arguments. An op is resolved by name
(`aten::add.Tensor`) only if it is on the allowlist (`allowlist.resolve`, when a program
arrives: gridgraph/trace/allowlist.py, the op vocabulary of the graph, by category), so no
private, unsafe, sparse-constructor, test or process-state op is callable. After each op,
the worker checks its result with `check_view`: every element a result's (sizes, strides,
storage offset) reaches lies inside its storage. Ops that return uninitialised memory
(`empty_like`, ...) have their result zero-filled, so no client reads bytes another client
freed. Ops whose CPU kernels index with their arguments unchecked (embedding, pooling
backward, batch norm, ctc_loss, ...) have them checked before they run (kernel_checks.py).

Random ops draw from the caller's own generator (`RandomState`), so `worker.manual_seed(s)`
makes them repeatable without touching anyone else's random state.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from functools import cache
from typing import Any

import torch

from gridgraph.exec.safety import kernel_checks
from gridgraph.exec.wire import MAX_DIMS
from gridgraph.trace.allowlist import UNINITIALIZED, OpRefused
from gridgraph.trace.meta import NEAREST_UPSAMPLINGS, extent, run_on_meta


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
        check_bounds(result)
    elif isinstance(result, (tuple, list)):
        for r in result:
            if isinstance(r, torch.Tensor):
                check_bounds(r)


def check_bounds(t: torch.Tensor) -> None:
    """`check_view` of one tensor."""
    if t.layout != torch.strided or not t.is_cpu:
        raise ViewOutOfBounds(f"an op returned a {t.layout} tensor on {t.device}: not allowed")
    if t.dim() > MAX_DIMS:  # (as the wire takes: the time estimate ignores dimensions)
        raise OpRefused(f"an op returned a tensor of {t.dim()} dimensions (at most {MAX_DIMS})")
    if t.is_contiguous():  # the common case, checked without walking sizes and strides:
        # a contiguous layout has non-negative strides and reaches offset + numel - 1
        offset = t.storage_offset()
        if offset >= 0 and (offset + t.numel()) * t.element_size() <= t.untyped_storage().nbytes():
            return
    _check_layout(t, t.shape, t.stride(), t.storage_offset())


def _check_layout(t: torch.Tensor, sizes: Any, strides: Any, offset: int) -> None:
    """Refuse a layout of `t`'s storage that reaches outside it."""
    sizes, strides = tuple(sizes), tuple(strides)
    if offset < 0 or any(s < 0 for s in strides) or any(n < 0 for n in sizes):
        raise ViewOutOfBounds(
            f"a view with negative sizes {sizes}, strides {strides} or offset {offset}"
        )
    if len(sizes) != len(strides) or 0 in sizes:
        return  # torch refuses the first itself; the second addresses no element
    need = extent(sizes, strides, offset) * t.element_size()
    have = t.untyped_storage().nbytes()
    if need > have:
        raise ViewOutOfBounds(
            f"a view of sizes {sizes}, strides {strides} and offset {offset} needs {need} "
            f"bytes of a storage of {have}"
        )


_RESIZE = (torch.ops.aten.resize_.default, torch.ops.aten.resize_as_.default)


def resizes(op: torch._ops.OpOverload) -> bool:
    """Whether `op` may grow its first argument's storage in place."""
    return op in _RESIZE


@cache
def _uninitialized(op: torch._ops.OpOverload) -> bool:
    return op._schema.name.removeprefix("aten::") in UNINITIALIZED


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

    def call(self, op: torch._ops.OpOverload, args: list, kwargs: dict) -> Any:
        """Run one resolved op: seeded ops draw from this stream; an uninitialised result is
        zero-filled."""
        return runner(op)(self, args, kwargs)

    def seeded(self, op: torch._ops.OpOverload, args: list, kwargs: dict) -> Any:
        with _global_rng:
            saved = torch.get_rng_state()
            torch.set_rng_state(self.state)
            try:
                return op(*args, **kwargs)
            finally:
                self.state = torch.get_rng_state()
                torch.set_rng_state(saved)


Runner = Callable[[RandomState, list, dict], Any]


@cache
def runner(op: torch._ops.OpOverload) -> Runner:
    """How a worker runs `op`, decided once per op: `runner(op)(rng, args, kwargs)`.

    Most ops are called as they are; uninitialised results are zero-filled, `as_strided_`
    is bounds-checked before it changes its tensor, memory `resize_` grows into is zeroed,
    seeded ops draw from the session's own stream `rng`, a nearest upsampling of an empty
    input is made without its kernel (`_upsample_nearest`), and the kernels that trust their
    arguments have them checked first (kernel_checks.py).
    """
    run = _runner(op)
    if op._schema.name not in kernel_checks.CHECKS:
        return run
    return lambda rng, args, kwargs: run(rng, *kernel_checks.checked_arguments(op, args, kwargs))


def _runner(op: torch._ops.OpOverload) -> Runner:
    if _uninitialized(op):
        return lambda rng, args, kwargs: op(*args, **kwargs).zero_()
    if op is torch.ops.aten.as_strided_.default:
        return _as_strided_
    if op in _RESIZE:
        return lambda rng, args, kwargs: _resize(op, args, kwargs)
    if _seeded(op):
        return lambda rng, args, kwargs: rng.seeded(op, args, kwargs)
    if op in NEAREST_UPSAMPLINGS:
        return lambda rng, args, kwargs: _upsample_nearest(op, args, kwargs)
    # What `op(...)` calls, without its Python frame (OpOverload.__call__ takes another path
    # only inside a __torch_function__ handler, which no worker thread runs in; `_op` is read
    # at each call, as torch may swap it).
    return lambda rng, args, kwargs: op._op(*args, **kwargs)


def _as_strided_(rng: RandomState, args: list, kwargs: dict) -> Any:
    t, sizes, strides, *rest = args  # checked before it changes the tensor
    _check_layout(t, sizes, strides, rest[0] if rest else t.storage_offset())
    return torch.ops.aten.as_strided_.default(*args, **kwargs)


def _upsample_nearest(op: torch._ops.OpOverload, args: list, kwargs: dict) -> Any:
    """An empty input's result is made, not computed: the CPU kernel still builds an index
    per output position (8 bytes each, for an output size of any size, charged nothing
    since the result holds no element)."""
    x = args[0] if args else None
    if isinstance(x, torch.Tensor) and x.numel() == 0:
        shaped = run_on_meta(op, [x.to("meta"), *args[1:]], kwargs)
        op(x, [1] * (x.dim() - 2))  # what the kernel refuses of its dtype, at no cost
        return torch.empty(shaped.shape, dtype=shaped.dtype)
    return op(*args, **kwargs)


def _resize(op: torch._ops.OpOverload, args: list, kwargs: dict) -> Any:
    """Memory a resize grows into is zeroed, never what was there before."""
    before = args[0].untyped_storage().nbytes()
    result = op(*args, **kwargs)
    storage = torch.empty(0, dtype=torch.uint8).set_(result.untyped_storage())
    storage[before:].zero_()
    return result
