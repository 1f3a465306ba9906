"""Every refusal in kernel_checks.py has its reason shown by a test.

A check refuses only what its kernel cannot take safely. For each place a check refuses,
one of:
- `test_kernel_checks.CASES`: arguments with which the kernel, unchecked, read or wrote
  out of bounds (or trapped); or
- `TORCH_REJECTS` below: arguments that plain torch rejects too (the check then refuses
  nothing torch runs; it stays because the kernel behind torch's own check is reached
  first by other arguments, or to name the argument in the error).
`NOT_YET_SHOWN` lists the refusals neither shows yet, with what the check guards.
"""

from __future__ import annotations

import traceback

import pytest
import torch

import gridgraph.exec.safety.kernel_checks as kernel_checks
from gridgraph.exec.safety.kernel_checks import KernelArgumentRefused, checked_arguments
from tests.exec.safety.test_kernel_checks import CASES, _last_call

aten = torch.ops.aten
LONG = torch.long
_lp = torch.randn(6, 2, 4).log_softmax(2)
_targets = torch.tensor([[1, 2, 1], [2, 3, 1]])
_rnn = [torch.randn(16, 3), torch.randn(16, 4), torch.randn(16), torch.randn(16),
        torch.zeros(1, 2, 4), torch.zeros(1, 2, 4)]  # fmt: skip

# name -> (op, args, kwargs): arguments plain torch rejects, and the checks refuse
TORCH_REJECTS = {
    "embedding: float indices": (
        aten.embedding.default, [torch.randn(5, 3), torch.tensor([0.5, 1.0])], {}),
    "_embedding_bag: offsets not from 0": (
        aten._embedding_bag.default,
        [torch.randn(10, 3), torch.tensor([1, 2, 3, 4]), torch.tensor([1, 2])], {}),
    "_embedding_bag: per_sample_weights short": (
        aten._embedding_bag.default,
        [torch.randn(10, 3), torch.tensor([1, 2, 3, 4]), torch.tensor([0, 2]), False, 0, False,
         torch.ones(2)], {}),
    "max_pool2d_with_indices_backward: a gradient of fewer dimensions": (
        aten.max_pool2d_with_indices_backward.default,
        [torch.ones(1, 2, 2), torch.randn(1, 1, 4, 4), [2, 2], [2, 2], [0, 0], [1, 1], False,
         torch.zeros(1, 2, 2, dtype=LONG)], {}),
    "convolution: a transposed output padding past the stride": (
        aten.convolution.default,
        [torch.ones(1, 1, 3, 3), torch.ones(1, 1, 1, 1), None, [1, 1], [0, 0], [1, 1], True,
         [2, 0], 1], {}),
    "_fft_c2r: a last_dim_size of 100 for 3 values": (
        aten._fft_c2r.default, [torch.ones(3, dtype=torch.cfloat), [0], 0, 100], {}),
    "native_batch_norm: a 1-D input": (
        aten.native_batch_norm.default, [torch.randn(4), None, None, None, None, True, 0.1, 1e-5],
        {}),
    "segment_reduce: axis 3 of 1-D data": (
        aten.segment_reduce.default, [torch.randn(6), "sum"],
        {"lengths": torch.tensor([2, 4]), "axis": 3}),
    "segment_reduce: lengths without a dimension past axis": (
        aten.segment_reduce.default, [torch.randn(3, 4), "sum"],
        {"lengths": torch.tensor([2, 2]), "axis": 1}),
    "segment_reduce: lengths adding up past the data": (
        aten.segment_reduce.default, [torch.randn(6), "sum"], {"lengths": torch.tensor([4, 4])}),
    "segment_reduce: offsets that go down": (
        aten.segment_reduce.default, [torch.randn(6), "sum"],
        {"offsets": torch.tensor([0, 4, 2])}),
    "flash attention: a 3-D query": (
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        [torch.randn(1, 4, 4), torch.randn(1, 4, 4), torch.randn(1, 4, 4)], {}),
    "_ctc_loss: 4-D log_probs": (
        aten._ctc_loss.default, [torch.randn(6, 2, 4, 1), _targets, [6, 6], [3, 3], 0, False], {}),
    "_ctc_loss: 1-D targets shorter than their lengths add up to": (
        aten._ctc_loss.default, [_lp, torch.tensor([1, 2, 1]), [6, 6], [3, 3], 0, False], {}),
    "_cdist_backward: batches that do not broadcast": (
        aten._cdist_backward.default,
        [torch.ones(2, 3, 5), torch.randn(2, 3, 4), torch.randn(3, 5, 4), 1.0,
         torch.ones(2, 3, 5)], {}),
    "mkldnn_rnn_layer: a 2-D input": (
        aten.mkldnn_rnn_layer.default,
        [torch.randn(2, 3), *_rnn, False, [], 2, 4, 1, True, False, False, False], {}),
    "mkldnn_rnn_layer: a mode that names no RNN": (
        aten.mkldnn_rnn_layer.default,
        [torch.randn(5, 2, 3), *_rnn, False, [], 9, 4, 1, True, False, False, False], {}),
}  # fmt: skip

# Refusals neither test shows yet (as their message begins) -> what the check guards. torch
# runs these arguments, or is never called with them; no out-of-bounds access is shown yet.
NOT_YET_SHOWN = {
    "offset2bag must name one bag per index":
        "the embedding bag backward kernels read one offset2bag entry per index",
    "bag_size must hold one size per bag":
        "the embedding bag backward kernels read one size per bag of the gradient",
    "an FFT's normalization must be 0, 1 or 2":
        "torch's CPU FFT takes any number here (the mode is cast to an enum, unchecked)",
    "dim, size or step do not unfold input_sizes":
        "torch's kernel runs a window past the dimension (a negative count of windows)",
}  # fmt: skip


@pytest.mark.parametrize("case", list(TORCH_REJECTS))
def test_a_refusal_torch_also_rejects(case):
    op, args, kwargs = TORCH_REJECTS[case]
    with pytest.raises(KernelArgumentRefused):
        checked_arguments(op, args, kwargs)
    with pytest.raises((RuntimeError, IndexError, ValueError)):
        op(*args, **kwargs)


def _refusing_line(op, args, kwargs) -> int:
    try:
        checked_arguments(op, args, kwargs)
    except KernelArgumentRefused as e:
        frames = traceback.extract_tb(e.__traceback__)
        return [f.lineno for f in frames if f.filename == kernel_checks.__file__][-1]
    raise AssertionError("not refused")


def test_every_refusal_is_shown_by_a_test_or_listed():
    source = open(kernel_checks.__file__).read().splitlines()
    refusals = {i + 1 for i, line in enumerate(source) if "raise KernelArgumentRefused" in line}
    shown = {_refusing_line(*_last_call(*CASES[c])) for c in CASES}
    shown |= {_refusing_line(*TORCH_REJECTS[c]) for c in TORCH_REJECTS}

    def message(line: int) -> str:  # (a message may start on the line after the raise)
        text = source[line - 1].split("KernelArgumentRefused(")[1] or source[line]
        return text.strip().strip("f\"'")

    unshown = sorted(message(line) for line in refusals - shown)
    listed = sorted(NOT_YET_SHOWN)
    assert [m for m in unshown if not m.startswith(tuple(listed))] == [], (
        f"refusals in kernel_checks.py with no test of their reason: {unshown}; add a case "
        "where torch rejects the same arguments (TORCH_REJECTS) or the kernel reads or writes "
        "out of bounds (test_kernel_checks.CASES)"
    )
    stale = [m for m in listed if not any(u.startswith(m) for u in unshown)]
    assert not stale, f"listed as not yet shown, but a test shows them now: {stale}"
