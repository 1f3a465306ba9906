"""A sent TransformerEncoder with a padding mask gives what torch gives, nested fast path or
not (gridgraph/trace/nested.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import gridgraph as gg

LEFT_ALIGNED = torch.tensor([[False] * 5, [False] * 3 + [True] * 2, [False] * 4 + [True]])
NOT_LEFT_ALIGNED = torch.tensor([[False] * 5, [True] + [False] * 4, [False] * 4 + [True]])


def _encoder(batch_first: bool = True, norm: bool = False, dropout: float = 0.1) -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=16, nhead=2, batch_first=batch_first,
                                       dropout=dropout)  # fmt: skip
    return nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(16) if norm else None)


@pytest.mark.parametrize(
    "batch_first, norm, padding",
    [
        (True, False, LEFT_ALIGNED),
        (True, True, LEFT_ALIGNED),
        (True, True, NOT_LEFT_ALIGNED),
        (False, False, LEFT_ALIGNED),
    ],
    ids=["nested", "nested-with-norm", "not-left-aligned", "sequence-first"],
)
def test_inference_with_a_padding_mask_gives_what_torch_gives(batch_first, norm, padding):
    model = _encoder(batch_first, norm).eval()
    local = copy.deepcopy(model)
    x = torch.randn(3, 5, 16) if batch_first else torch.randn(5, 3, 16)
    with torch.no_grad():
        want = local(x, src_key_padding_mask=padding)
    with gg.local_grid(1) as grid:
        w0 = grid.workers[0]
        gg.send(model, w0)
        with torch.no_grad():
            got = model(gg.send(x, w0), src_key_padding_mask=gg.send(padding, w0)).get()
        assert model.use_nested_tensor == local.use_nested_tensor  # (set back after the call)
    torch.testing.assert_close(got, want)
    if batch_first and padding is LEFT_ALIGNED:  # torch's nested path: padded gives norm(0)
        zero = local.norm(torch.zeros(16)) if norm else torch.zeros(16)
        torch.testing.assert_close(want[1, 3], zero.detach())


def test_training_with_a_padding_mask_is_unchanged():
    model = _encoder(dropout=0.0)
    local = copy.deepcopy(model)
    x = torch.randn(3, 5, 16)
    want = local(x, src_key_padding_mask=LEFT_ALIGNED)
    want.sum().backward()
    with gg.local_grid(1) as grid:
        w0 = grid.workers[0]
        gg.send(model, w0)
        got = model(gg.send(x, w0), src_key_padding_mask=gg.send(LEFT_ALIGNED, w0))
        got.sum().backward()
        torch.testing.assert_close(got.get(), want.detach())
        for (name, p), q in zip(model.named_parameters(), local.parameters(), strict=True):
            torch.testing.assert_close(p.grad.get(), q.grad, msg=name)


def test_recorded_inference_with_a_padding_mask_gives_what_torch_gives():
    model = _encoder().eval()
    local = copy.deepcopy(model)
    x = torch.randn(3, 5, 16)
    with torch.no_grad():
        want = local(x, src_key_padding_mask=LEFT_ALIGNED)
    with gg.local_grid(1) as grid:
        w0 = grid.workers[0]
        gg.send(model, w0)
        with torch.no_grad(), gg.trace():
            got = model(gg.send(x, w0), src_key_padding_mask=gg.send(LEFT_ALIGNED, w0))
        torch.testing.assert_close(got.get(), want)
