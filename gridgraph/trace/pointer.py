"""`RemoteTensor`: a pointer to a tensor on a worker, usable as a torch.Tensor.

It is a wrapper subclass: it carries shape, strides and dtype but no data, and every ATen
call on it is recorded (`record.py`). Autograd runs above it unchanged, so `requires_grad`,
`.backward()`, `.grad` and `torch.optim` work on pointers as on local tensors.

A pointer names one value id at a time. An in-place op rebinds it to the value that op
produces (the same storage on the worker), which is how `x.add_(1)` keeps `x` meaning "the
latest contents of x". An in-place op that changes the shape or strides (`x.t_()`,
`x.squeeze_()`, `x.resize_(n)`) also gives the pointer the new layout, as torch does.
"""

from __future__ import annotations

from typing import Any

import torch

from gridgraph.errors import GridError
from gridgraph.trace.meta import TensorMeta
from gridgraph.trace.record import record

_make_wrapper = torch.Tensor._make_wrapper_subclass
_CPU = torch.device("cpu")  # a device object, not a string parsed per pointer


class RemoteTensor(torch.Tensor):
    """A torch.Tensor whose data lives on a worker; ops on it are recorded, not run."""

    _owner: Any  # the client that holds this pointer (gridgraph.exec.client.client.Client)
    _vid: int  # the value it names now

    @staticmethod
    def __new__(cls, owner: Any, value_id: int, meta: TensorMeta, requires_grad: bool = False):
        if cls is RemoteTensor and meta.dtype in _INDEX_DTYPES:
            cls = IndexPointer
        if meta.offset or requires_grad:
            t = _make_wrapper(
                cls,
                meta.shape,
                strides=meta.stride,
                storage_offset=meta.offset,
                dtype=meta.dtype,
                device=_CPU,
                requires_grad=requires_grad,
            )
        else:  # most pointers: torch parses each keyword, so leave out the defaults
            t = _make_wrapper(cls, meta.shape, strides=meta.stride, dtype=meta.dtype, device=_CPU)
        if meta.bits:
            meta.mark(t)
        t._owner = owner
        t._vid = value_id
        return t

    # Dispatch-level only: no __torch_function__ overhead, no subclass wrapping above ATen.
    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return record(func, args, kwargs or {}, RemoteTensor)

    def _set_meta(self, meta: TensorMeta) -> None:
        """Take the shape, strides and offset an in-place op gave this tensor (transpose_,
        squeeze_, resize_, as_strided_ ...). The pointer's storage is a data-less stand-in:
        a fresh one of the size the new layout needs keeps torch's bounds checks happy."""
        stand_in = torch.Tensor._make_wrapper_subclass(
            RemoteTensor, meta.shape, strides=meta.stride, storage_offset=meta.offset,
            dtype=meta.dtype, device="cpu",
        )  # fmt: skip
        with torch._C._DisableTorchDispatch():  # set_ here must not be recorded
            torch.ops.aten.set_.source_Storage_storage_offset(
                self, stand_in.untyped_storage(), meta.offset, meta.shape, meta.stride
            )

    @property
    def data(self) -> torch.Tensor:
        return torch._C.TensorBase.data.__get__(self, type(self))

    @data.setter
    def data(self, new: torch.Tensor) -> None:
        """`p.data = q` (as `model.double()` does): `p` names `q`'s value from now on,
        sharing its storage as torch's tensors do, and keeps its autograd identity."""
        if not isinstance(new, RemoteTensor) or new._owner is not self._owner:
            raise TypeError(
                "p.data = t needs a pointer of the same grid as p; send t first "
                "(gg.send(t, worker))"
            )
        view = torch.ops.aten.alias.default(new)  # a new value on q's storage
        self._owner.rebind(self, view._vid)
        view._cell.vid = None  # the value is `self`'s now, not freed with `view`
        meta = TensorMeta.of(view)
        stand_in = torch.Tensor._make_wrapper_subclass(
            RemoteTensor, meta.shape, strides=meta.stride, storage_offset=meta.offset,
            dtype=meta.dtype, device="cpu",
        )  # fmt: skip
        torch._C.TensorBase.data.__set__(self, stand_in)  # shape, strides and dtype
        if meta.bits:
            meta.mark(self)

    # --- what users call ---------------------------------------------------------------------

    def compute(self) -> RemoteTensor:
        """Run what this pointer needs on the workers; the result stays remote."""
        self._owner.compute([self])
        return self

    def get(self) -> torch.Tensor:
        """The value as a plain local tensor (runs what it needs first)."""
        return self._owner.fetch(self._vid)

    @property
    def location(self) -> str | None:
        """Name of the worker holding this value, or None while it is not computed."""
        return self._owner.location_of(self._vid)

    @property
    def computed(self) -> bool:
        """Whether the value exists on a worker now (False once its grid is closed)."""
        return self.location is not None

    def to(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """`p.to(dtype)` is recorded like any op; a GPU device is refused (`cuda`)."""
        device = kwargs.get("device", args[0] if args else None)  # (torch's own parser
        if isinstance(device, torch.Tensor):  # refuses `copy`, which .to takes)
            device = device.device
        if isinstance(device, str | int | torch.device) and torch.device(device).type != "cpu":
            raise GridError(_NOT_ON_GPU.format(call=f".to({device})"))
        return super().to(*args, **kwargs)

    def cuda(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Refused: a pointer's value stays on its worker, which computes on CPU."""
        raise GridError(_NOT_ON_GPU.format(call=".cuda()"))

    def __deepcopy__(self, memo: dict) -> RemoteTensor:
        """A copy on the same worker (a remote clone): what `copy.deepcopy(model)` makes of
        a sent model's parameters and buffers (EMA and best-checkpoint patterns). It keeps
        `requires_grad` (a leaf), a parameter's mark and a copy of `.grad`."""
        if id(self) in memo:
            return memo[id(self)]
        with torch.no_grad():
            copy = torch.ops.aten.clone.default(self)
        if self.requires_grad:
            copy.requires_grad_(True)
        if getattr(self, "_is_param", False):
            copy._is_param = True
        memo[id(self)] = copy
        if self.grad is not None:
            copy.grad = self.grad.__deepcopy__(memo)
        return copy

    def move(self, worker: Any) -> RemoteTensor:
        """Move this (computed) value to another worker of the same grid; returns self."""
        self._owner.move(self, worker)
        return self

    def tolist(self) -> Any:
        return self.get().tolist()

    def numpy(self, *, force: bool = False) -> Any:
        return self.get().numpy(force=force)

    def __format__(self, spec: str) -> str:
        if self.dim() == 0 and spec:
            return format(self.item(), spec)
        return repr(self)

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        where = self.location
        if getattr(self._owner, "closed", False):
            state = "grid closed: its value is gone"
        else:
            state = f"location={where!r}, computed=True" if where else "computed=False"
        grad = ", requires_grad=True" if self.requires_grad else ""
        return f"RemoteTensor(shape={tuple(self.shape)}, dtype={self.dtype}, {state}{grad})"

    def __reduce_ex__(self, protocol: int):
        raise TypeError("a RemoteTensor cannot be pickled; call .get() for its value")


class IndexPointer(RemoteTensor):
    """A pointer to an integer tensor: what can hold indices. A few torch functions read
    an index tensor's values straight from memory in C++ (`tensor_split(x, indices)`),
    where a pointer has none; this type catches those above dispatch and fetches the values
    first (a sync point, like `.item()`). Only integer pointers pay for the check."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _READS_VALUES:
            args, kwargs = _READS_VALUES[func](args, kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


_NOT_ON_GPU = (
    "{call} on a pointer: its value stays on its worker, which computes on CPU; bring it "
    "home first (p.get(), gg.get(model)), then call {call} on the local tensor"
)
_INDEX_DTYPES = frozenset({torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8})


def _split_points(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """tensor_split(x, indices_or_sections) with a tensor: its int or list of ints."""
    for name in ("indices_or_sections", "tensor_indices_or_sections"):
        if isinstance(kwargs.get(name), RemoteTensor):
            kwargs = {**kwargs, name: kwargs[name].tolist()}
    if len(args) > 1 and isinstance(args[1], RemoteTensor):
        args = (args[0], args[1].tolist(), *args[2:])
    return args, kwargs


# Functions whose composite kernels read an index tensor's data pointer (not through .item(),
# which records), with what turns their pointer arguments into values.
_READS_VALUES = {torch.tensor_split: _split_points, torch.Tensor.tensor_split: _split_points}
