"""Tensor metadata and shape inference on the meta device.

Recording an op must tell the user the shape, strides and dtype of its result without running
it. We run the op on meta tensors (PyTorch's shape-only device); the recorder runs `infer` once
per distinct (op, argument metadata) and caches what comes out with the rest of what it derives
from the call (`record.Recipe`), so recording a training step for the second time costs a
dictionary look-up per op.

Ops whose output shape depends on the data (nonzero, unique, masked_select, ...) have no meta
kernel; `infer` raises `DataDependent` for them and the recorder runs them for real. So do ops
whose meta kernel fails because it reads values (`allclose` calls `.item()`, `tensor_split`
wants its indices on the CPU): a meta kernel that raises is never the last word, the worker
runs the op and either gives the result or raises torch's own error. Where a meta kernel is
wrong about what the CPU kernel does, `run_on_meta` (which workers' checks use too) follows
the CPU kernel.

A layout is (shape, stride, storage offset): `extent` is how far one reaches into its storage
(the recorder's and the worker's bounds checks both ask it), and `meta_tensor` makes a meta
tensor of one (the recorder's on the smallest storage, the worker's on its tensor's own).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch


class TensorMeta(NamedTuple):
    """What the client knows about a remote tensor: everything but its values."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype
    # Lazy conjugate / negation bits of complex views (x.conj()): 1 conj, 2 neg. Code above
    # ATen branches on them (x.is_conj()), so a pointer carries the ones torch would have.
    bits: int = 0

    @classmethod
    def of(cls, t: torch.Tensor) -> TensorMeta:
        bits = t.is_conj() | t.is_neg() << 1 if t.dtype.is_complex else 0
        return cls(tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype, bits)

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * self.dtype.itemsize

    def on_meta(self) -> torch.Tensor:
        """A meta tensor with exactly this layout (strides and storage offset included), on
        the smallest storage that holds it."""
        return self.mark(meta_tensor(self.shape, self.stride, self.offset, self.dtype))

    def mark(self, t: torch.Tensor) -> torch.Tensor:
        """`t` with this metadata's conjugate and negation bits set."""
        if self.bits & 1:
            torch._C._set_conj(t, True)
        if self.bits & 2:
            torch._C._set_neg(t, True)
        return t


def extent(shape: Sequence[int], stride: Sequence[int], offset: int) -> int:
    """Elements of storage a layout reaches: one past its last element (its offset when it
    addresses none)."""
    if 0 in shape:
        return offset
    return offset + sum((n - 1) * s for n, s in zip(shape, stride)) + 1


def meta_tensor(
    shape: Sequence[int],
    stride: Sequence[int],
    offset: int,
    dtype: torch.dtype,
    storage: int | None = None,
) -> torch.Tensor:
    """A meta tensor of this layout on a storage of `storage` elements (by default its
    `extent`: the fewest that hold it)."""
    if storage is None:
        storage = extent(shape, stride, offset)
    base = torch.empty(storage, dtype=dtype, device="meta")
    return base.as_strided(shape, stride, offset)


def as_sent(t: torch.Tensor, copy: bool = False) -> torch.Tensor:
    """A local tensor as a worker receives it (`gg.send`, or mixed into an op): its values,
    row-major from offset 0, lazy conjugation applied; a copy only when `t` is not so already
    or `copy` is set (a value sent later must not see the user's later writes to `t`).
    What the client records about it must describe this, not the sender's layout."""
    t = t.detach().resolve_conj().resolve_neg()
    row_major, n = [], 1
    for size in reversed(t.shape):
        row_major.append(n)
        n *= size
    if t.storage_offset() == 0 and t.stride() == tuple(reversed(row_major)):
        return t.clone() if copy else t
    return t.clone(memory_format=torch.contiguous_format)


class DataDependent(Exception):
    """The op's output metadata depends on the input values; it must run to be known.

    `error` is what the meta kernel raised when it failed rather than declining (it may be
    the user's own mistake, such as mismatched shapes)."""

    def __init__(self, message: str, error: Exception | None = None) -> None:
        super().__init__(message)
        self.error = error


class OutputSpec(NamedTuple):
    """The structure of an op's result: `kind` is 'tensor', 'tuple', 'list' or 'none'.

    A tuple may hold None where the op returns no tensor (convolution_backward for a
    gradient nobody asked for)."""

    kind: str
    metas: tuple[TensorMeta | None, ...]


def warm_up() -> None:
    """Import in the background what torch's meta kernels import on their first call:
    `torch._dynamo` (torch/_compile.py's `_disable_dynamo`), 2-3 s of imports that else
    fall on the first op recorded. A grid's client calls it when it starts."""
    if "torch._dynamo" not in sys.modules:
        threading.Thread(target=_import_dynamo, name="gridgraph-warm-up", daemon=True).start()


def _import_dynamo() -> None:
    import torch._dynamo  # noqa: F401


def run_on_meta(op: torch._ops.OpOverload, args: list[Any], kwargs: dict[str, Any]) -> Any:
    """`op(*args, **kwargs)` on meta-device arguments, as the CPU kernel would shape it.

    Where torch's meta kernel is wrong about an empty input, the CPU kernel's rule stands in
    for it (`_EMPTY_INPUT_RULES`): the client records by this and workers check by it, so
    both must agree with what the op gives."""
    x = args[0] if args else None
    if isinstance(x, torch.Tensor) and x.numel() == 0:
        rule = _EMPTY_INPUT_RULES.get(op)
        if rule is not None:
            return rule(op, x, list(args[1:]), kwargs)
    return op(*args, **kwargs)


def _nearest_upsampling(op: torch._ops.OpOverload, x: torch.Tensor, rest: list, kwargs: dict):
    """Meta passes an int to `torch._check` (TypeError "cond must be a bool"); the CPU kernel
    returns an empty, contiguous batch, and refuses an input empty in any other dimension."""
    if 0 in x.shape[1:]:
        raise RuntimeError(
            f"Non-empty {x.dim()}D data tensor expected but got a tensor with sizes {list(x.shape)}"
        )
    # Its sizes and arguments checked on a batch of one, then the empty batch.
    one = op(x.new_empty((1, *x.shape[1:])), *rest, **kwargs)
    return one.new_empty((0, *one.shape[1:]))


def _pixel_unshuffle(op: torch._ops.OpOverload, x: torch.Tensor, rest: list, kwargs: dict):
    """Meta reshapes an empty input (and skips the divisibility checks); the CPU kernel checks
    it, then returns an empty tensor of the input's own shape."""
    factor = rest[0] if rest else kwargs.get("downscale_factor")
    stand_in = [s or factor for s in x.shape] if type(factor) is int and factor > 0 else x.shape
    op(x.new_empty(stand_in), *rest, **kwargs)  # (0 is divisible by anything: a factor is)
    return x.new_empty(x.shape)


def _vector_norm(op: torch._ops.OpOverload, x: torch.Tensor, rest: list, kwargs: dict):
    """Meta refuses an inf norm of an empty input over a negative dim even where that dim is
    not empty (it checks the dim before wrapping it); the CPU kernel reduces it."""
    dims = rest[1] if len(rest) > 1 else kwargs.get("dim")
    if isinstance(dims, list) and x.dim() and all(type(d) is int for d in dims):
        wrapped = [d % x.dim() if -x.dim() <= d < 0 else d for d in dims]
        if len(rest) > 1:
            rest = [rest[0], wrapped, *rest[2:]]
        else:
            kwargs = {**kwargs, "dim": wrapped}
    return op(x, *rest, **kwargs)


NEAREST_UPSAMPLINGS = frozenset(
    getattr(getattr(torch.ops.aten, f"{name}{d}d"), overload)
    for name in ("upsample_nearest", "_upsample_nearest_exact")
    for d in (1, 2, 3)
    for overload in ("default", "vec")
)
_EMPTY_INPUT_RULES = {
    **dict.fromkeys(NEAREST_UPSAMPLINGS, _nearest_upsampling),
    torch.ops.aten.pixel_unshuffle.default: _pixel_unshuffle,
    torch.ops.aten.linalg_vector_norm.default: _vector_norm,
}


def infer(op: torch._ops.OpOverload, args: list[Any], kwargs: dict[str, Any]) -> OutputSpec:
    """Output metadata of `op` run on these meta-device arguments."""
    try:
        out = run_on_meta(op, args, kwargs)
    except NotImplementedError as e:
        # No meta kernel: nonzero, masked_select, unique, boolean indexing, equal, ...
        raise DataDependent(str(e)) from e
    except RuntimeError as e:
        # A meta kernel that reads values (.item(), indices it wants on the CPU), or a
        # mistake in the call that running it for real reports as torch would.
        raise DataDependent(str(e), e) from e
    return _spec_of(out)


def _spec_of(out: Any) -> OutputSpec:
    if isinstance(out, torch.Tensor):
        return OutputSpec("tensor", (TensorMeta.of(out),))
    if out is None:
        return OutputSpec("none", ())
    if isinstance(out, (tuple, list)) and all(
        isinstance(o, torch.Tensor) or o is None for o in out
    ):
        kind = "tuple" if isinstance(out, tuple) else "list"
        return OutputSpec(kind, tuple(None if o is None else TensorMeta.of(o) for o in out))
    # A Python value (bool, int, ...) is data: the op must run for real.
    raise DataDependent(f"returns {type(out).__name__}")
