"""Hand-made messages, as a hostile peer builds them: any header, any data region.

`frame` lays a header and a data region out exactly as `wire.encode` does, but takes the
header as given, so a test can put in it what the encoder never would (two tensors over the
same bytes, a wrong byte count, an unknown extension). `tensor_ref` is the header's pointer
to a tensor in the data region.
"""

from __future__ import annotations

from typing import Any

import msgpack

ALIGN = 64


def tensor_ref(dtype: str, shape: list[int], offset: int, nbytes: int) -> msgpack.ExtType:
    """A tensor in a header: `[dtype, shape, offset, nbytes]` into the data region."""
    return msgpack.ExtType(3, msgpack.packb([dtype, shape, offset, nbytes]))


def frame(header: Any, data: bytes = b"", *, default=None) -> bytearray:
    """A message with this header (packed as is) and this data region."""
    packed = msgpack.packb(header, use_bin_type=True, default=default)
    pad = bytes(-(4 + len(packed)) % ALIGN)
    return bytearray(len(packed).to_bytes(4, "little") + packed + pad + data)
