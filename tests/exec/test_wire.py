"""The wire format: what goes in comes out, and every decoded tensor is aligned for its dtype."""

from __future__ import annotations

import pytest
import torch

from gridgraph.exec import wire


@pytest.mark.parametrize("dtype", list(wire.DTYPES.values()), ids=str)
@pytest.mark.parametrize("header_pad", range(0, 17))
def test_decoded_tensors_are_aligned_for_their_dtype(dtype, header_pad):
    # The header's length varies with its content; the data must stay aligned whatever it is.
    tensors = [torch.arange(n).to(dtype) for n in (1, 3, 7)]
    payload = wire.encode({"kind": "x", "pad": "p" * header_pad, "ts": tensors})
    got = wire.decode(payload)["ts"]
    for sent, received in zip(tensors, got):
        assert received.data_ptr() % dtype.itemsize == 0
        assert torch.equal(sent, received)


def test_complex_results_from_a_worker_are_usable(local_grid):
    # A misaligned complex128 view crashed torch.testing.assert_close with a segfault.
    x = torch.randn(5, 3)
    got = x.send(local_grid.workers[0]).cdouble().get()
    torch.testing.assert_close(got, x.cdouble())
    assert got.data_ptr() % got.dtype.itemsize == 0
