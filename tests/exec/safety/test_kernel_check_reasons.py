"""Every refusal in kernel_checks.py has its reason shown by a test.

A check refuses only what its kernel cannot take safely. For each place a check refuses,
one of:
- `test_kernel_checks.CASES`: arguments with which the kernel, unchecked, read or wrote
  out of bounds (or trapped); or
- `READS_PAST` below: the same, shown by a test here; or
- `TORCH_REJECTS` below: arguments that plain torch rejects too (the check then refuses
  nothing torch runs; it stays because the kernel behind torch's own check is reached
  first by other arguments, or to name the argument in the error).
`NOT_YET_SHOWN` lists the refusals neither shows yet, with what the check guards.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import traceback

import pytest
import torch

import gridgraph as gg
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
    "_embedding_bag: last offset included, no offsets": (
        aten._embedding_bag.default,
        [torch.randn(10, 3), torch.tensor([1, 2, 3]), torch.tensor([], dtype=LONG), False, 0,
         False, None, True], {}),
    "_embedding_bag_backward: offset2bag shorter than the indices": (
        aten._embedding_bag_backward.default,
        [torch.ones(1, 4), torch.zeros(8, dtype=LONG), torch.tensor([0]), torch.tensor([0]),
         torch.tensor([8]), torch.empty(0, dtype=LONG), 10, False, 1, False, None, -1], {}),
    "unfold_backward: a step of 0": (
        aten.unfold_backward.default, [torch.ones(1, 3), [3], 0, 3, 0], {}),
    "unfold_backward: a window past the dimension, no windows in the gradient": (
        aten.unfold_backward.default, [torch.ones(0, 4), [3], 0, 4, 1], {}),
    "mkldnn_rnn_layer: a mode that names no RNN": (
        aten.mkldnn_rnn_layer.default,
        [torch.randn(5, 2, 3), *_rnn, False, [], 9, 4, 1, True, False, False, False], {}),
}  # fmt: skip

# name -> (op, args, kwargs): arguments a kernel reads past with, shown by a test below
READS_PAST = {
    "_embedding_bag_per_sample_weights_backward: offset2bag shorter than the indices": (
        aten._embedding_bag_per_sample_weights_backward.default,
        [torch.ones(1, 1), torch.rand(10, 1), torch.zeros(1 << 22, dtype=LONG),
         torch.tensor([0]), torch.tensor([0]), 0, -1], {}),
    "_embedding_bag_backward: bag_size shorter than the bags": (
        aten._embedding_bag_backward.default,
        [torch.ones(4, 1), torch.zeros(4, dtype=LONG), torch.arange(4), torch.arange(4),
         torch.tensor([1, 4, 4, 4])[:1], torch.empty(0, dtype=LONG), 10, False, 1, False, None,
         -1], {}),
}  # fmt: skip

# Refusals neither test shows yet (as their message begins) -> what the check guards. torch
# runs these arguments, or is never called with them; no out-of-bounds access is shown yet.
NOT_YET_SHOWN: dict[str, str] = {}


# Refusals whose reason a test elsewhere shows (as their message begins) -> that test
SHOWN_ELSEWHERE = {
    "{name} must be a {kind.__name__}":
        "test_kernel_sweep.py::test_a_dtype_given_as_a_number_is_refused_before_its_meta_run",
    "{name} of {scale:g} maps output pixels":
        "test_kernel_sweep.py::test_a_tiny_scale_crashes_a_plain_uint8_nearest_upsampling",
}  # fmt: skip


@pytest.mark.parametrize("case", list(TORCH_REJECTS))
def test_a_refusal_torch_also_rejects(case):
    op, args, kwargs = TORCH_REJECTS[case]
    with pytest.raises(KernelArgumentRefused):
        checked_arguments(op, args, kwargs)
    with pytest.raises((RuntimeError, IndexError, ValueError)):
        op(*args, **kwargs)


def test_offset2bag_shorter_than_the_indices_segfaults_the_kernel():
    """Unchecked, the per-sample-weights backward reads one offset2bag entry per index: 4M
    past a one-entry tensor, a segfault (in a child process here; the worker refuses)."""
    case = "_embedding_bag_per_sample_weights_backward: offset2bag shorter than the indices"
    with pytest.raises(KernelArgumentRefused, match="offset2bag"):
        checked_arguments(*READS_PAST[case])
    child = subprocess.run(
        [sys.executable, "-c", _PER_SAMPLE_WEIGHTS_BACKWARD_SHORT_OFFSET2BAG], timeout=120
    )
    assert child.returncode == -signal.SIGSEGV


_PER_SAMPLE_WEIGHTS_BACKWARD_SHORT_OFFSET2BAG = """
import torch
torch.ops.aten._embedding_bag_per_sample_weights_backward(
    torch.ones(1, 1), torch.rand(10, 1), torch.zeros(1 << 22, dtype=torch.long),
    torch.tensor([0]), torch.tensor([0]), 0, -1)
"""


def test_bag_size_shorter_than_the_bags_is_read_past():
    """Unchecked, a mean bag backward reads one bag_size per bag: given a one-element view
    of [1, 4, 4, 4], it divides by the 4s past the view's end (on a worker, whatever memory
    follows the tensor)."""
    op, args, kwargs = READS_PAST["_embedding_bag_backward: bag_size shorter than the bags"]
    with pytest.raises(KernelArgumentRefused, match="bag_size"):
        checked_arguments(op, args, kwargs)
    grad_weight = op(*args, **kwargs)
    assert grad_weight[0].item() == 1 + 3 / 4  # bag 0 by its size 1, bags 1..3 by the 4s


def test_longer_offset2bag_and_bag_size_run_as_in_torch():
    """Entries past the indices and bags are not read: torch runs them, so does a worker."""
    weight, indices, offsets = torch.randn(10, 4), torch.tensor([1, 2, 3]), torch.tensor([0, 2])
    _, offset2bag, bag_size, max_indices = aten._embedding_bag(weight, indices, offsets, False, 1)
    grad = torch.randn(2, 4)
    args = [grad, indices, offsets, torch.cat([offset2bag, torch.tensor([1, 0])]),
            torch.cat([bag_size, torch.tensor([5])]), max_indices, 10, False, 1, False, None,
            -1]  # fmt: skip
    want = aten._embedding_bag_backward(*args)
    with gg.local_grid(1) as grid:
        remote = [gg.send(a, grid.workers[0]) if isinstance(a, torch.Tensor) else a for a in args]
        got = aten._embedding_bag_backward(*remote).get()
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("normalization", [3, -1, 100])
def test_an_fft_normalization_outside_0_to_2_runs_as_in_torch(normalization):
    """torch's FFT kernels take any normalization number (one that is not 0 or 1 scales by
    1/n): no memory is indexed by it, so a worker runs what torch runs."""
    x = torch.randn(8, dtype=torch.cfloat)
    want = aten._fft_c2c(x, [0], normalization, True)
    with gg.local_grid(1) as grid:
        got = aten._fft_c2c(gg.send(x, grid.workers[0]), [0], normalization, True).get()
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("mode", [0, 1])
def test_sum_and_mean_bags_with_one_offset_and_the_last_included_run_as_in_torch(mode):
    """With include_last_offset and a single offset there are no bags: sum and mean make an
    empty result (max wrote before its output: refused, test_kernel_checks)."""
    weight, indices = torch.randn(10, 4), torch.tensor([1, 2, 3])
    args = [weight, indices, torch.tensor([0]), False, mode, False, None, True]
    want = aten._embedding_bag(*args)
    with gg.local_grid(1) as grid:
        remote = [gg.send(a, grid.workers[0]) if isinstance(a, torch.Tensor) else a for a in args]
        got = aten._embedding_bag(*remote)
        got = [t.get() for t in got]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("windows", [1, 2])
def test_unfold_backward_with_a_window_past_the_dimension_runs_as_in_torch(windows):
    """torch runs it (reading the gradient's windows, within it); so does a worker."""
    grad = torch.randn(2, windows, 10)
    want = aten.unfold_backward(grad, [2, 3], 1, 10, 1)
    with gg.local_grid(1) as grid:
        got = aten.unfold_backward(gg.send(grad, grid.workers[0]), [2, 3], 1, 10, 1).get()
    torch.testing.assert_close(got, want)


def test_the_backward_of_bags_with_one_offset_and_the_last_included_reads_past_grad():
    """Such a call makes no bags, and its gradient no rows; torch's backward still sums row 0
    of it into each index's row (from offsets: bag 0 for every index): past a 0-row view of
    [1..40], it reads 1, 2, 3, 4. The worker refuses it (the forward runs, test above)."""
    indices, offsets = torch.tensor([1, 2, 3]), torch.tensor([0])
    _, offset2bag, bag_size, max_indices = aten._embedding_bag(
        torch.randn(10, 4), indices, offsets, False, 0, False, None, True
    )
    args = [torch.arange(1.0, 41.0).reshape(10, 4)[:0], indices, offsets, offset2bag, bag_size,
            max_indices, 10, False, 0, False, None, -1]  # fmt: skip
    with pytest.raises(KernelArgumentRefused, match="more bags than grad has rows"):
        checked_arguments(aten._embedding_bag_backward.default, args, {})
    grad_weight = aten._embedding_bag_backward(*args)
    assert grad_weight[1].tolist() == [1.0, 2.0, 3.0, 4.0]


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
    shown |= {_refusing_line(*READS_PAST[c]) for c in READS_PAST}

    def message(line: int) -> str:  # (a message may start on the line after the raise)
        text = source[line - 1].split("KernelArgumentRefused(")[1] or source[line]
        return text.strip().strip("f\"'")

    unshown = sorted(message(line) for line in refusals - shown)
    listed = sorted(NOT_YET_SHOWN | SHOWN_ELSEWHERE)
    assert [m for m in unshown if not m.startswith(tuple(listed))] == [], (
        f"refusals in kernel_checks.py with no test of their reason: {unshown}; add a case "
        "where torch rejects the same arguments (TORCH_REJECTS) or the kernel reads or writes "
        "out of bounds (test_kernel_checks.CASES)"
    )
    stale = [m for m in listed if not any(u.startswith(m) for u in unshown)]
    assert not stale, f"listed as not yet shown, but a test shows them now: {stale}"
