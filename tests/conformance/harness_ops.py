"""OpInfo entries that misbehave on purpose through pointers, to test the harness itself.

Each behaves like `torch.neg` on local tensors; on a pointer, outside `gg.trace()`, it does
what its name says. The sweep's children load them when $GG_CONFORMANCE_EXTRA names this
module (`load_entries`); they are not PyTorch ops and never part of the real sweep.
"""

from __future__ import annotations

import ctypes
import time

import torch
from torch.testing._internal.opinfo.core import OpInfo, SampleInput

import gridgraph as gg
from gridgraph.trace.record import tracing


def _samples(op, device, dtype, requires_grad, **kwargs):
    yield SampleInput(torch.linspace(-1, 1, 6, dtype=dtype).reshape(2, 3))


def _misbehaving(name: str, on_pointer):
    def op(x):
        if isinstance(x, gg.RemoteTensor) and not tracing():
            return on_pointer(x)
        return torch.neg(x)

    return OpInfo(
        f"harness.{name}",
        op=op,
        dtypes=(torch.float32,),
        sample_inputs_func=_samples,
        supports_autograd=False,
    )


def _refuse(x):
    raise gg.RecordError("refused on purpose")


EXTRA_OPS = [
    _misbehaving("segfault", lambda x: ctypes.string_at(0)),
    _misbehaving("hang", lambda x: time.sleep(3600)),
    _misbehaving("wrong", lambda x: torch.neg(x) + 1),
    _misbehaving("refuse", _refuse),
    _misbehaving("neg", torch.neg),
]
