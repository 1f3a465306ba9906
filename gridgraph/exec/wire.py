"""The wire format: msgpack envelopes, tensors as dtype + shape + raw bytes.

A message is framed as

    [4 bytes: length n of the msgpack header] [msgpack header] [zero padding]
    [tensor data, from offset align64(4 + n); each tensor at a 64-byte aligned offset]

The header is a msgpack map; a tensor in it is only `[dtype, shape, offset, nbytes]`
pointing into the data region, so tensor bytes are copied once when a message is built and
never again when it is read: the receiver's tensors are views of the received buffer.

Nothing received is unpickled, evaluated or imported. Every non-msgpack value travels as an
extension type that decodes to a plain value from a fixed table:

    1 Slot(k)      2 Param(k)     3 tensor      4 dtype     5 device ("cpu" only)
    6 memory format / layout      7 complex

The receiver checks that each tensor's byte count matches its shape and dtype and lies
inside the data region before building it. Kernels need tensors aligned for their dtype (a
misaligned complex128 crashes some): offsets are aligned within the message, and a tensor
whose address is still misaligned (the buffer itself was, as a slice of a network read can
be) is copied into fresh memory rather than viewed.
"""

from __future__ import annotations

from typing import Any

import msgpack
import torch

from gridgraph.schedule.plan import Param, Slot

DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64,
        torch.complex128, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
        torch.bool,
    )
}  # fmt: skip
_ENUMS = {
    str(v).removeprefix("torch."): v
    for v in (
        torch.contiguous_format, torch.channels_last, torch.preserve_format,
        torch.channels_last_3d, torch.strided,
    )
}  # fmt: skip


class WireError(ValueError):
    """A message that does not decode to a valid gridgraph message."""


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of `t` in row-major order (no copy when it is already contiguous)."""
    dense = t.detach().resolve_conj().resolve_neg().contiguous()  # lazy x.conj(): its values
    # as_strided: a contiguous tensor may keep any stride on a dimension of size 1 (x.expand
    # of one element has stride 0), which view(uint8) refuses.
    flat = dense.as_strided((dense.numel(),), (1,))
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


_ALIGN = 64


class _Encoder:
    """Packs one message; tensors go to the data region, the header points at them."""

    def __init__(self) -> None:
        self.chunks: list[memoryview] = []
        self.size = 0

    def tensor(self, t: torch.Tensor) -> msgpack.ExtType:
        name = str(t.dtype).removeprefix("torch.")
        if name not in DTYPES:
            raise WireError(f"dtype {t.dtype} cannot be sent")
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


def _unpack_tensor(obj: Any, data: memoryview) -> torch.Tensor:
    try:
        name, shape, offset, nbytes = obj
    except (TypeError, ValueError):
        raise WireError("a tensor must be [dtype, shape, offset, nbytes]") from None
    dtype = DTYPES.get(name)
    if dtype is None:
        raise WireError(f"unknown dtype {name!r}")
    if not isinstance(shape, list) or not all(type(s) is int and s >= 0 for s in shape):
        raise WireError(f"bad shape {shape!r}")
    if type(offset) is not int or type(nbytes) is not int or offset < 0 or nbytes < 0:
        raise WireError("bad tensor offset or size")
    numel = 1
    for s in shape:
        numel *= s
    if numel * dtype.itemsize != nbytes:
        raise WireError(
            f"tensor of shape {shape} and dtype {name} needs {numel * dtype.itemsize} bytes, "
            f"got {nbytes}"
        )
    if offset + nbytes > len(data):
        raise WireError("tensor data lies outside the message")
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    tensor = torch.frombuffer(data, dtype=dtype, count=numel, offset=offset)
    if tensor.data_ptr() % dtype.itemsize:  # a misaligned buffer: never hand it to a kernel
        tensor = tensor.clone()
    return tensor.reshape(shape)


def _default(obj: Any) -> Any:
    if type(obj) is Slot:
        return msgpack.ExtType(1, msgpack.packb(obj.index))
    if type(obj) is Param:
        return msgpack.ExtType(2, msgpack.packb(obj.index))
    if isinstance(obj, torch.dtype):
        return msgpack.ExtType(4, str(obj).removeprefix("torch.").encode())
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
        re, im = msgpack.unpackb(data)
        return complex(float(re), float(im))
    raise WireError(f"unknown extension type {code}")


def _int(data: bytes) -> int:
    v = msgpack.unpackb(data)
    if type(v) is not int or v < 0:
        raise WireError("a slot or parameter index must be a non-negative int")
    return v


def encode(message: dict) -> bytearray:
    """A message (a dict of plain values, tensors, slots ...) as one buffer."""
    enc = _Encoder()
    header = msgpack.packb(message, default=enc.default, use_bin_type=True)
    pad = bytes(-(4 + len(header)) % _ALIGN)
    return bytearray().join([len(header).to_bytes(4, "little"), header, pad, *enc.chunks])


def decode(payload: bytes | bytearray) -> dict:
    """A buffer back into a message; raises WireError for anything malformed.

    Tensors are views of the buffer: pass a bytearray (as `encode` makes) to avoid a copy.
    """
    if len(payload) < 4:
        raise WireError("message too short")
    n = int.from_bytes(payload[:4], "little")
    if 4 + n > len(payload):
        raise WireError("message header is truncated")
    if not isinstance(payload, bytearray) and len(payload) > 4 + n:
        payload = bytearray(payload)  # tensors need a writable buffer
    data = memoryview(payload)[4 + n + -(4 + n) % _ALIGN :]

    def ext_hook(code: int, ext: bytes) -> Any:
        if code == 3:
            return _unpack_tensor(msgpack.unpackb(ext), data)
        return _ext_hook(code, ext)

    try:
        msg = msgpack.unpackb(
            memoryview(payload)[4 : 4 + n], ext_hook=ext_hook, raw=False, strict_map_key=False
        )
    except WireError:
        raise
    except Exception as e:  # msgpack raises several unrelated types for garbage
        raise WireError(f"undecodable message: {e}") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("kind"), str):
        raise WireError("a message must be a map with a 'kind'")
    return msg
