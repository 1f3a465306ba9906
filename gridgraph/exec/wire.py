"""The wire format: msgpack envelopes, tensors as dtype + shape + raw bytes.

A message is [4 bytes: length n of the msgpack header] [msgpack header] [zero padding]
[tensor data from offset align64(4 + n), each tensor 64-byte aligned]. A tensor in the
header is only `[dtype, shape, offset, nbytes]` pointing into the data region: its bytes are
copied once when a message is built. A message of one large tensor is read as a view of the
buffer; the tensors of a message of several are copied out, each into memory of its own (a
view would keep every other tensor's bytes alive, uncounted); small ones of the dtypes numpy
shares are copied as they are read, through numpy, which releases the interpreter lock.

Nothing received is unpickled, evaluated or imported: every non-msgpack value is an
extension type from a fixed table (1 Slot, 2 Param, 3 tensor, 4 dtype, 5 device ("cpu"
only), 6 memory format / layout, 7 complex). Nothing received is trusted: `decode` refuses
with `WireError`, before anything uses the message, a message over the caller's limit, a
header over MAX_HEADER_BYTES or with more than MAX_TENSORS tensors (what bounds the memory
decoding takes), a header of more arrays and maps than one per BYTES_PER_CONTAINER bytes
(`unpackb`: what bounds the time decoding takes), a tensor whose size does not match its
shape and dtype, that lies outside the data region or is misaligned, or has more than
MAX_DIMS dimensions, two tensors over the same bytes, a data region larger than its tensors
and padding, and a bool tensor holding a byte other than 0 or 1. A buffer not aligned for
the largest dtype is copied once into aligned memory (kernels need aligned tensors).
"""

from __future__ import annotations

import ctypes
import gc
from typing import Any

import msgpack
import numpy as np
import torch

from gridgraph.schedule.program import Param, Slot

DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64,
        torch.complex128, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint64,
        torch.uint32, torch.uint16, torch.uint8, torch.bool,
    )
}  # fmt: skip


def _numpy_dtype(dtype: torch.dtype) -> np.dtype | None:
    try:
        return torch.empty(0, dtype=dtype).numpy().dtype
    except TypeError:  # bfloat16: numpy has none
        return None


# The dtypes whose bytes numpy reads and writes: their tensors are packed and unpacked through
# numpy, with no torch call. Each torch call releases the interpreter lock; on a local grid,
# where the client and the workers are threads of one process, that hands it to another
# thread and waits to get it back, several times per tensor.
_NUMPY = {d: n for d in DTYPES.values() if (n := _numpy_dtype(d)) is not None}
_NUMPY_MAX_DIMS = 32  # (numpy 1 takes at most 32 dimensions, numpy 2 64; torch more)
_ENUMS = {
    str(v).removeprefix("torch."): v
    for v in (
        torch.contiguous_format, torch.channels_last, torch.preserve_format,
        torch.channels_last_3d, torch.strided,
    )
}  # fmt: skip


class WireError(ValueError):
    """A message that does not decode to a valid gridgraph message."""


class CostlyHeader(WireError):
    """A header of more arrays and maps than its size allows: one no honest peer makes."""


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of `t` in row-major order (no copy when it is already contiguous)."""
    if not (
        t.is_cpu
        and t.layout == torch.strided
        and not t.requires_grad
        and not t.is_conj()
        and not t.is_neg()
        and t.is_contiguous()
    ):  # (the usual case is read as it is, with no torch call)
        t = t.detach().resolve_conj().resolve_neg().contiguous()  # lazy x.conj(): its values
    nbytes = t.numel() * t.element_size()
    if not nbytes:
        return memoryview(b"")
    # Read in place, not through `t.numpy()`: that marks the storage as one torch may never
    # grow, and a worker refused `resize_` on every value it had sent or returned.
    memory = (ctypes.c_char * nbytes).from_address(t.data_ptr())
    memory.tensor = t  # (kept alive as long as a view of its bytes)
    return memoryview(memory).cast("B")


_ALIGN = 64
MAX_HEADER_BYTES = 1 << 20  # a 6-layer transformer's training step is a 90 kB program
MAX_TENSORS = 1 << 14
MAX_DIMS = 64
# A header holds at most one array or map per this many of its bytes, and CONTAINERS_FLOOR
# more (a program's step is ~40 bytes and 5 containers; the headers of a transformer's
# training step hold one per 13-23 bytes). Each container decoded costs an allocation: a
# 0.9 MB header of empty lists took 90-290 ms to decode, a header of as many small ints 10.
BYTES_PER_CONTAINER = 4
CONTAINERS_FLOOR = 64
COPY_BELOW = 1 << 16  # bytes: a tensor this small is copied as it is read
_MAX_ITEMSIZE = max(d.itemsize for d in DTYPES.values())


class _Encoder:
    """Packs one message; tensors go to the data region, the header points at them."""

    def __init__(self) -> None:
        self.chunks: list[memoryview] = []
        self.size = 0

    def tensor(self, t: torch.Tensor) -> msgpack.ExtType:
        name = str(t.dtype).removeprefix("torch.")
        if name not in DTYPES:
            raise WireError(f"dtype {t.dtype} cannot be sent")
        if t.dim() > MAX_DIMS:
            raise WireError(f"a tensor of {t.dim()} dimensions cannot be sent (at most {MAX_DIMS})")
        data = tensor_bytes(t)
        pad = -self.size % _ALIGN
        if pad:
            self.chunks.append(memoryview(bytes(pad)))
        offset = self.size + pad
        self.chunks.append(data)
        self.size = offset + data.nbytes
        return msgpack.ExtType(3, msgpack.packb([name, list(t.shape), offset, data.nbytes]))

    def default(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return self.tensor(obj)
        return _default(obj)


class _Decoder:
    """Builds the tensors of one message as views of its data region, and checks them."""

    def __init__(self, data: memoryview) -> None:
        self.data = data
        self.regions: list[tuple[int, int]] = []  # (offset, end) of each tensor
        self.total = 0  # bytes of all tensors so far
        self.views: list[torch.Tensor] = []  # the tensors that view the data region

    def tensor(self, obj: Any) -> torch.Tensor:
        try:
            name, shape, offset, nbytes = obj
        except (TypeError, ValueError):
            raise WireError("a tensor must be [dtype, shape, offset, nbytes]") from None
        if len(self.regions) >= MAX_TENSORS:
            raise WireError(f"a message holds at most {MAX_TENSORS} tensors")
        dtype = DTYPES.get(name) if isinstance(name, str) else None
        if dtype is None:
            raise WireError(f"unknown dtype {name!r}")
        if not isinstance(shape, list) or not all(type(s) is int and s >= 0 for s in shape):
            raise WireError(f"bad shape {shape!r:.80}")
        if len(shape) > MAX_DIMS:
            raise WireError(f"a tensor of {len(shape)} dimensions (at most {MAX_DIMS})")
        if type(offset) is not int or type(nbytes) is not int or offset < 0 or nbytes < 0:
            raise WireError("bad tensor offset or size")
        numel = 1
        for s in shape:
            numel *= s
        if numel * dtype.itemsize != nbytes:
            raise WireError(
                f"tensor of shape {shape} and dtype {name} needs {numel * dtype.itemsize} "
                f"bytes, got {nbytes}"
            )
        if offset + nbytes > len(self.data):
            raise WireError("tensor data lies outside the message")
        self.total += nbytes  # (tensors that share no byte hold no more than the region)
        if self.total > len(self.data):
            raise WireError(
                f"the message's tensors hold more bytes than its data region of "
                f"{len(self.data)}: some overlap"
            )
        if offset % _ALIGN:
            raise WireError(f"tensor data at offset {offset} is not {_ALIGN}-byte aligned")
        self.regions.append((offset, offset + nbytes))
        if numel == 0:
            return torch.empty(shape, dtype=dtype)
        if dtype in _NUMPY and len(shape) <= _NUMPY_MAX_DIMS:  # (see _NUMPY)
            array = np.frombuffer(self.data, dtype=_NUMPY[dtype], count=numel, offset=offset)
            if dtype == torch.bool and array.view(np.uint8).max() > 1:
                raise WireError("a bool tensor holds a byte other than 0 and 1")
            if nbytes <= COPY_BELOW:  # memory of its own at once (torch's: it can grow)
                # (numpy may not write it: a storage numpy shares never grows, so memmove)
                tensor = torch.empty(shape, dtype=dtype)
                ctypes.memmove(tensor.data_ptr(), array.ctypes.data, nbytes)
                return tensor
            tensor = torch.from_numpy(array.reshape(shape))
        else:
            flat = torch.frombuffer(self.data, dtype=dtype, count=numel, offset=offset)
            if dtype == torch.bool and flat.view(torch.uint8).max() > 1:
                raise WireError("a bool tensor holds a byte other than 0 and 1")
            # Over the same storage, but no view of `flat` (whose `_base` would keep it, and
            # with it the whole region, alive through `own_memory`).
            storage = flat.untyped_storage()
            tensor = torch.empty(0, dtype=dtype).set_(storage, flat.storage_offset(), shape)
        self.views.append(tensor)
        return tensor

    def check_regions(self) -> None:
        """No two tensors share a byte, and no byte of the data region lies outside every
        tensor but for alignment padding."""
        regions = sorted(r for r in self.regions if r[0] < r[1])
        for (_, end), (start, _) in zip(regions, regions[1:]):
            if start < end:
                raise WireError("two tensors of the message overlap")
        covered = sum(end - start + -(end - start) % _ALIGN for start, end in regions)
        if len(self.data) > covered:
            raise WireError(
                f"the message's data region holds {len(self.data) - covered} bytes that no "
                f"tensor covers"
            )

    def own_memory(self) -> None:
        """Give each tensor memory of its own, if the data region holds several."""
        if len(self.regions) > 1:
            for tensor in self.views:
                tensor.set_(tensor.clone())


def _aligned(data: memoryview) -> memoryview:
    """`data`, copied once into fresh aligned memory if it is misaligned for any dtype."""
    if not len(data):
        return data
    address = np.frombuffer(data, dtype=np.uint8).ctypes.data
    if address % _MAX_ITEMSIZE == 0:
        return data
    fresh = torch.empty(len(data), dtype=torch.uint8)  # torch allocates 64-byte aligned
    fresh.copy_(torch.frombuffer(data, dtype=torch.uint8))
    return memoryview(fresh.numpy())


def _default(obj: Any) -> Any:
    if type(obj) is Slot:
        return msgpack.ExtType(1, msgpack.packb(obj.index))
    if type(obj) is Param:
        return msgpack.ExtType(2, msgpack.packb(obj.index))
    if isinstance(obj, torch.dtype):
        name = str(obj).removeprefix("torch.")
        if name not in DTYPES:  # the receiver would drop the whole message
            raise WireError(f"dtype {obj} cannot be sent (workers take {', '.join(DTYPES)})")
        return msgpack.ExtType(4, name.encode())
    if isinstance(obj, torch.device):
        return msgpack.ExtType(5, obj.type.encode())
    if isinstance(obj, (torch.memory_format, torch.layout)):
        return msgpack.ExtType(6, str(obj).removeprefix("torch.").encode())
    if isinstance(obj, complex):
        return msgpack.ExtType(7, msgpack.packb([obj.real, obj.imag]))
    raise WireError(f"cannot send a value of type {type(obj).__name__}")


def _ext_hook(code: int, data: bytes) -> Any:
    if code == 1:
        return Slot(_int(data))
    if code == 2:
        return Param(_int(data))
    if code == 4:
        dtype = DTYPES.get(data.decode(errors="replace"))
        if dtype is None:
            raise WireError(f"unknown dtype {data!r}")
        return dtype
    if code == 5:
        if data != b"cpu":
            raise WireError(f"unsupported device {data!r}")
        return torch.device("cpu")
    if code == 6:
        value = _ENUMS.get(data.decode(errors="replace"))
        if value is None:
            raise WireError(f"unknown memory format or layout {data!r}")
        return value
    if code == 7:
        try:
            re, im = unpackb(data, max_containers=1, max_array_len=2)
            return complex(float(re), float(im))
        except (TypeError, ValueError):
            raise WireError("a complex number must be [real, imag]") from None
    raise WireError(f"unknown extension type {code}")


def _int(data: bytes) -> int:
    v = unpackb(data, max_containers=0)
    if type(v) is not int or v < 0:
        raise WireError("a slot or parameter index must be a non-negative int")
    return v


def unpackb(data: bytes | memoryview, *, max_containers: int, **caps: Any) -> Any:
    """`msgpack.unpackb(data)` at a cost that `data`'s size bounds, whatever its shape:
    raises WireError, having built at most `max_containers` + 1 arrays and maps, for more
    of them; `caps` are msgpack's own (max_array_len, max_map_len, ...: each refused as
    soon as its header is read). Nesting stops at msgpack's stack of 1024. For every
    msgpack a peer sends: headers here, envelopes and sealed messages on IPFS.

    >>> unpackb(msgpack.packb([[1], {}]), max_containers=3)
    [[1], {}]
    """
    built = 0

    def counted(container: Any) -> Any:  # (msgpack calls it for each array and each map)
        nonlocal built
        built += 1
        if built > max_containers:
            raise CostlyHeader(f"more than {max_containers} arrays and maps")
        return container

    caps.setdefault("strict_map_key", False)
    try:
        return msgpack.unpackb(data, list_hook=counted, object_hook=counted, **caps)
    except WireError:
        raise
    except Exception as e:  # msgpack raises several unrelated types for garbage
        raise WireError(f"undecodable message: {e}") from None


def header_size(payload: bytes | bytearray | memoryview) -> int:
    """The size of a message's header, read without decoding it (0 if it has none)."""
    return int.from_bytes(payload[:4], "little") if len(payload) >= 4 else 0


def encode(message: dict) -> bytearray:
    """A message (a dict of plain values, tensors, slots ...) as one buffer."""
    enc = _Encoder()
    header = msgpack.packb(message, default=enc.default, use_bin_type=True)
    pad = bytes(-(4 + len(header)) % _ALIGN)
    return bytearray().join([len(header).to_bytes(4, "little"), header, pad, *enc.chunks])


def decode(payload: bytes | bytearray, max_bytes: int | None = None) -> dict:
    """A buffer back into a message; raises WireError for anything malformed or too large.

    Tensors are views of the buffer: pass a bytearray (as `encode` makes) to avoid a copy.
    """
    if max_bytes is not None and len(payload) > max_bytes:
        raise WireError(f"message of {len(payload)} bytes is over the limit of {max_bytes}")
    if len(payload) < 4:
        raise WireError("message too short")
    n = int.from_bytes(payload[:4], "little")
    if n > MAX_HEADER_BYTES:
        raise WireError(f"message header of {n} bytes is over the limit of {MAX_HEADER_BYTES}")
    if 4 + n > len(payload):
        raise WireError("message header is truncated")
    start = 4 + n + -(4 + n) % _ALIGN
    if not isinstance(payload, bytearray) and len(payload) > start:
        payload = bytearray(payload)  # tensors need a writable buffer
    data = memoryview(payload)[start:]
    decoder = None  # made at the first tensor: most messages (requests, replies) hold none

    def ext_hook(code: int, ext: bytes) -> Any:
        nonlocal decoder
        if code != 3:
            return _ext_hook(code, ext)
        if decoder is None:
            decoder = _Decoder(_aligned(data))
        return decoder.tensor(unpackb(ext, max_containers=2))

    # No garbage collection while the header is built: its containers hold no cycles, yet
    # each 700 of them made set off a collection, and every few of those one over the whole
    # heap (torch's objects too). A 1 MiB header of empty lists took 0.8 s, holding the
    # interpreter lock, on the thread every sender's messages arrive on; 0.04 s without.
    # Small headers too: each collection promotes the containers still being built, and a
    # stream of 4 KiB ones set off collections over the whole heap, at 10 times the cost.
    collecting = gc.isenabled()
    gc.disable()
    try:
        msg = unpackb(
            memoryview(payload)[4 : 4 + n],
            max_containers=CONTAINERS_FLOOR + n // BYTES_PER_CONTAINER,
            ext_hook=ext_hook,
            raw=False,
        )
    finally:
        if collecting:  # (left off if the program had turned it off)
            gc.enable()
    if decoder is None and data:
        decoder = _Decoder(data)  # (no tensor: it says which bytes none covers)
    if decoder is not None:
        decoder.check_regions()
    if not isinstance(msg, dict) or not isinstance(msg.get("kind"), str):
        raise WireError("a message must be a map with a 'kind'")
    if decoder is not None:
        decoder.own_memory()
    return msg
