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
"""

from __future__ import annotations

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
        """A meta tensor with exactly this layout (strides and storage offset included)."""
        extent = 1 + sum((s - 1) * st for s, st in zip(self.shape, self.stride) if s > 0)
        if 0 in self.shape:
            extent = 0
        base = torch.empty(self.offset + extent, dtype=self.dtype, device="meta")
        return self.mark(base.as_strided(self.shape, self.stride, self.offset))

    def mark(self, t: torch.Tensor) -> torch.Tensor:
        """`t` with this metadata's conjugate and negation bits set."""
        if self.bits & 1:
            torch._C._set_conj(t, True)
        if self.bits & 2:
            torch._C._set_neg(t, True)
        return t


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


def run_on_meta(op: torch._ops.OpOverload, args: list[Any], kwargs: dict[str, Any]) -> Any:
    """`op(*args, **kwargs)` on meta-device arguments, as the CPU kernel would shape it.

    Where torch's meta kernel is wrong, the CPU kernel's rule stands in for it (the client
    records by this and workers check by it, so both must agree with what the op gives):
    the nearest-neighbour upsamplings pass an int to `torch._check` for an empty input
    (TypeError "cond must be a bool"), where the CPU kernel returns an empty, contiguous
    batch, or refuses an input empty in any other dimension."""
    if (
        op in NEAREST_UPSAMPLINGS
        and args
        and isinstance(args[0], torch.Tensor)
        and args[0].numel() == 0
    ):
        x = args[0]
        if 0 in x.shape[1:]:
            raise RuntimeError(
                f"Non-empty {x.dim()}D data tensor expected but got a tensor with sizes "
                f"{list(x.shape)}"
            )
        # Its sizes and arguments checked on a batch of one, then the empty batch.
        one = op(x.new_empty((1, *x.shape[1:])), *args[1:], **kwargs)
        return one.new_empty((0, *one.shape[1:]))
    return op(*args, **kwargs)


NEAREST_UPSAMPLINGS = frozenset(
    getattr(getattr(torch.ops.aten, f"{name}{d}d"), overload)
    for name in ("upsample_nearest", "_upsample_nearest_exact")
    for d in (1, 2, 3)
    for overload in ("default", "vec")
)


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
