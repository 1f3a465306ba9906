"""Tensors a decomposition allocates, allocated beside the pointers it was called with.

Policy: while torch's decomposition of a call on pointers runs (record.py records its ops
one by one), the empty, zero, one and filled tensors it allocates on the CPU (a scratch
buffer, an accumulator, an `out=` target) are allocated as `new_*` of the call's first
pointer: recorded, so on a worker, placed as any op is. torch allocates them on the
inputs' device so that the decomposition's writes into them stay there; allocated locally,
a write of remote data into one would be refused ("an op writes to a local tensor using
remote data"). Other tensors a decomposition makes (an `arange` of indices) are read only,
and stay local constants. The same holds for a custom op's own backward (torch calls
it with the gradients: pointers, here), which allocates its buffers the same way.

State: the mode on torch's dispatch stack while a decomposition runs; each custom op
decomposed through pointers has its backward wrapped once (`allocate_in_backward`); the
wrapper changes nothing when neither a gradient nor a saved tensor is a pointer.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten


def _dtype(kwargs: dict) -> torch.dtype:
    return kwargs.get("dtype") or torch.get_default_dtype()


# factory op -> how to make the same tensor as a `new_*` of `anchor`: (anchor, args, kwargs)
_BESIDE = {
    aten.empty.memory_format: lambda a, args, kw: aten.new_empty(a, args[0], dtype=_dtype(kw)),
    aten.empty_strided.default: lambda a, args, kw: aten.new_empty_strided(
        a, args[0], args[1], dtype=_dtype(kw)
    ),
    aten.zeros.default: lambda a, args, kw: aten.new_zeros(a, args[0], dtype=_dtype(kw)),
    aten.ones.default: lambda a, args, kw: aten.new_ones(a, args[0], dtype=_dtype(kw)),
    aten.full.default: lambda a, args, kw: aten.new_full(
        a, args[0], args[1], dtype=kw.get("dtype") or torch.full((), args[1]).dtype
    ),
}
_CPU = torch.device("cpu")
_KEEPS_LAYOUT = (None, torch.contiguous_format, torch.preserve_format)


class AllocateBeside(TorchDispatchMode):
    """`with AllocateBeside(pointer):` the allocations above made as `new_*` of `pointer`."""

    def __init__(self, anchor: torch.Tensor) -> None:
        super().__init__()
        self.anchor = anchor

    def __torch_dispatch__(self, func, types, args=(), kwargs=None) -> Any:
        kwargs = kwargs or {}
        beside = _BESIDE.get(func)
        if (
            beside is not None
            and kwargs.get("device") in (None, _CPU, "cpu")
            and kwargs.get("layout") in (None, torch.strided)
            and kwargs.get("memory_format") in _KEEPS_LAYOUT
            and not kwargs.get("pin_memory")
        ):
            return beside(self.anchor, args, kwargs)
        return func(*args, **kwargs)


def allocate_in_backward(opdef: Any, pointer_type: type) -> None:
    """Wrap the backward of custom op `opdef` (torch reads `opdef._backward_fn` at each
    backward) so that, called with a pointer among its gradients (or else among what its
    forward saved), it allocates beside it."""
    backward = getattr(opdef, "_backward_fn", None)
    if backward is None or getattr(backward, "allocates_beside", False):
        return

    def beside(ctx: Any, *grads: Any) -> Any:
        anchor = _pointer_among(grads, pointer_type)
        if anchor is None:  # (local gradients of an op on pointers: what it saved)
            anchor = _pointer_among((*ctx.saved_tensors, *vars(ctx).values()), pointer_type)
        if anchor is None:
            return backward(ctx, *grads)
        with AllocateBeside(anchor):
            return backward(ctx, *grads)

    beside.allocates_beside = True
    opdef._backward_fn = beside


def _pointer_among(values: tuple, pointer_type: type) -> Any:
    return next((v for v in values if isinstance(v, pointer_type)), None)
