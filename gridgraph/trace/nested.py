"""TransformerEncoder's nested-tensor fast path, taken on pointers as torch takes it locally.

Policy: in eval mode without gradients, given a padding mask, torch's `TransformerEncoder`
converts its input to a nested tensor (dropping the padded positions), runs its layers on
that, and pads the result back with zeros. Nested tensors cannot be sent, so a sent encoder
takes the dense path instead, and its result is then given what the nested path gives: 0 at
the padded positions (`norm(0)` where the encoder has a final norm), when the mask is
left-aligned (torch checks that first, unless `mask_check` is off; its dense path runs
otherwise). The other positions are the same up to rounding.

State: a sent encoder gets a forward pre-hook and hook (once). While its call runs,
`use_nested_tensor` is False on it, which is what steers torch to the dense path.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

_KEY = "_gg_nested_call"  # on a running encoder: what its pre-hook found (a stack)


def follow_nested_fast_path(module: nn.Module) -> None:
    """Hook each `nn.TransformerEncoder` in `module` so that, called on pointers, it gives
    what torch's nested fast path gives."""
    for m in module.modules():
        if isinstance(m, nn.TransformerEncoder) and not hasattr(m, _KEY):
            setattr(m, _KEY, [])
            m.register_forward_pre_hook(_before, with_kwargs=True)
            m.register_forward_hook(_after, with_kwargs=True, always_call=True)


def _inputs(args: tuple, kwargs: dict) -> tuple[Any, Any, Any]:
    """(src, mask, src_key_padding_mask) of a TransformerEncoder call."""
    names = ("src", "mask", "src_key_padding_mask")
    bound = dict(zip(names, args)) | {k: v for k, v in kwargs.items() if k in names}
    return bound.get("src"), bound.get("mask"), bound.get("src_key_padding_mask")


def _takes_nested_path(encoder: nn.TransformerEncoder, src: Any, mask: Any, padding: Any) -> bool:
    """Whether torch's forward would convert to nested tensors, but for the mask's alignment
    (TransformerEncoder.forward's conditions, in its order)."""
    first = encoder.layers[0]
    if not first.self_attn.batch_first:  # (torch's init turns use_nested_tensor off then)
        return False
    if not (
        torch.backends.mha.get_fastpath_enabled() and getattr(encoder, "use_nested_tensor", False)
    ):
        return False
    if first.training or not isinstance(src, torch.Tensor) or src.dim() != 3 or padding is None:
        return False
    if getattr(encoder, "mask_check", True) and torch.compiler.is_compiling():
        return False
    if src.is_nested or mask is not None or torch.is_autocast_enabled():
        return False
    attention = first.self_attn
    weights = (src, attention.in_proj_weight, attention.in_proj_bias,
               attention.out_proj.weight, attention.out_proj.bias, first.norm1.weight,
               first.norm1.bias, first.norm2.weight, first.norm2.bias, first.linear1.weight,
               first.linear1.bias, first.linear2.weight, first.linear2.bias)  # fmt: skip
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in weights))


def _before(encoder: nn.TransformerEncoder, args: tuple, kwargs: dict) -> None:
    src, mask, padding = _inputs(args, kwargs)
    nested = _takes_nested_path(encoder, src, mask, padding)
    getattr(encoder, _KEY).append(nested)
    if nested:
        encoder.use_nested_tensor = False


def _after(encoder: nn.TransformerEncoder, args: tuple, kwargs: dict, output: Any) -> Any:
    if not getattr(encoder, _KEY).pop():
        return None
    encoder.use_nested_tensor = True
    if output is None:  # (forward raised)
        return None
    src, _, padding = _inputs(args, kwargs)
    keep = padding.logical_not()  # (a float mask keeps where it is 0, as torch reads it)
    padded = keep.logical_not()
    if getattr(encoder, "mask_check", True):  # torch's nested path only for left-aligned
        left_aligned = (keep[:, 1:] > keep[:, :-1]).any().logical_not()
        padded = padded & left_aligned
    padded = padded.unsqueeze(-1)
    if encoder.norm is None:
        return output.masked_fill(padded, 0.0)
    return torch.where(padded, encoder.norm(torch.zeros_like(output)), output)
