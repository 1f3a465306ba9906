"""Kernels that trust their arguments: a second peer crafts them, the worker refuses them.

Each case is one found by adversarial review (repro: the arguments below). Unchecked, each
read or wrote past its tensors on the worker: an abort or segfault of the whole process,
heap corruption, or bytes from outside the tensors in the result. Now each is refused
before the kernel runs, with an error naming the argument, and the worker keeps serving.
Honest arguments (those torch's own forward ops make) are covered by the conformance suite.
"""

from __future__ import annotations

import copy

import pytest
import torch

import gridgraph as gg
from gridgraph.exec.safety.kernel_checks import KernelArgumentRefused, checked_arguments
from gridgraph.schedule.program import Slot
from gridgraph.trace.allowlist import resolve
from tests.exec import hostile
from tests.exec.local_peer import Peer

LONG, INT = torch.long, torch.int32


def _channels_last(*shape: int) -> tuple[torch.Tensor, list]:
    """A tensor to permute on the worker into a channels-last layout of `shape`."""
    n, c, *rest = shape
    return torch.randn(n, *rest, c), [0, len(shape) - 1, *range(1, len(shape) - 1)]


_x_cl, _cl = _channels_last(2, 3, 4, 4)
_one_cl, _ = _channels_last(2, 1, 4, 4)
_lp = torch.randn(6, 2, 4).log_softmax(2)
_targets = torch.tensor([[1, 2, 1], [2, 3, 1]])
_nll, _alpha = torch.ops.aten._ctc_loss(_lp, _targets, [6, 6], [3, 3], 0, False)
_sym = torch.randn(4, 4, dtype=torch.float64)
_ld = torch.ops.aten.linalg_ldl_factor_ex(_sym + _sym.T)[0]

_rnn_in, _rnn_h = torch.randn(5, 2, 3), torch.randn(1, 2, 4)
_rnn_w = [torch.randn(16, 3), torch.randn(16, 4), torch.randn(16), torch.randn(16)]
_rnn_out = torch.ops.aten.mkldnn_rnn_layer(_rnn_in, *_rnn_w, _rnn_h, _rnn_h, False, [], 2, 4, 1,
                                           True, False, False, True)  # fmt: skip

# name -> (inputs (slots 0..), steps), each step's outputs in the slots after the inputs
CASES = {
    "segment_reduce_backward: lengths past the data (abort)": (
        [torch.ones(2), torch.ones(2), torch.arange(6.0), torch.tensor([2, 400])],
        [["aten::_segment_reduce_backward", [Slot(0), Slot(1), Slot(2), "sum"],
          {"lengths": Slot(3)}, 1]],
    ),
    "segment_reduce: offsets before the data (read)": (
        [torch.arange(6.0), torch.tensor([-10, 2, 6])],
        [["aten::segment_reduce", [Slot(0), "sum"], {"offsets": Slot(1)}, 1]],
    ),
    "max_pool2d_with_indices_backward: an index past the plane (segfault)": (
        [torch.ones(1, 1, 2, 2), torch.randn(1, 1, 4, 4), torch.tensor([[[[1 << 40, 0], [1, 2]]]])],
        [["aten::max_pool2d_with_indices_backward",
          [Slot(0), Slot(1), [2, 2], [2, 2], [0, 0], [1, 1], False, Slot(2)], {}, 1]],
    ),
    "adaptive_max_pool2d_backward: an index before the plane (write)": (
        [torch.ones(1, 1, 2, 2), torch.randn(1, 1, 4, 4), torch.tensor([[[[-50, 0], [1, 2]]]])],
        [["aten::adaptive_max_pool2d_backward", [Slot(0), Slot(1), Slot(2)], {}, 1]],
    ),
    "adaptive_max_pool2d_backward: channels-last, fewer channels (segfault)": (
        [torch.ones(2, 1, 2, 2), _x_cl, torch.zeros(2, 1, 2, 2, dtype=LONG)],
        [["aten::permute", [Slot(1), _cl], {}, 1],
         ["aten::adaptive_max_pool2d_backward", [Slot(0), Slot(3), Slot(2)], {}, 1]],
    ),
    "_adaptive_avg_pool2d_backward: channels-last, more channels (abort)": (
        [torch.ones(2, 3, 2, 2), _one_cl],
        [["aten::permute", [Slot(1), _cl], {}, 1],
         ["aten::_adaptive_avg_pool2d_backward", [Slot(0), Slot(2)], {}, 1]],
    ),
    "native_batch_norm: one running mean for three channels (write)": (
        [torch.randn(2, 3, 4), torch.ones(3), torch.zeros(1), torch.ones(1)],
        [["aten::native_batch_norm",
          [Slot(0), Slot(1), None, Slot(2), Slot(3), True, 0.1, 1e-5], {}, 3]],
    ),
    "native_batch_norm_backward: one saved mean for three channels (read)": (
        [torch.randn(2, 3, 4), torch.randn(2, 3, 4), torch.ones(3), torch.zeros(1), torch.ones(1)],
        [["aten::native_batch_norm_backward",
          [Slot(0), Slot(1), Slot(2), None, None, Slot(3), Slot(4), True, 1e-5,
           [True, True, True]], {}, 3]],
    ),
    "native_layer_norm_backward: one mean for six rows (read)": (
        [torch.randn(2, 3, 4), torch.randn(2, 3, 4), torch.zeros(1), torch.ones(1)],
        [["aten::native_layer_norm_backward",
          [Slot(0), Slot(1), [4], Slot(2), Slot(3), None, None, [True, False, False]], {}, 3]],
    ),
    "linalg_ldl_solve: a 2 x 2 block left open (segfault)": (
        [_ld, torch.tensor([-1, 2, 3, 4], dtype=INT), torch.randn(4, 2, dtype=torch.float64)],
        [["aten::linalg_ldl_solve", [Slot(0), Slot(1), Slot(2)], {"hermitian": True}, 1]],
    ),
    "rrelu_with_noise: expanded noise (write)": (
        [torch.randn(2, 4), torch.ones(1)],
        [["aten::expand", [Slot(1), [2, 4]], {}, 1],
         ["aten::rrelu_with_noise", [Slot(0), Slot(2), 0.1, 0.3, True], {}, 1]],
    ),
    "flash attention: values longer than keys (segfault)": (
        [torch.randn(1, 1, 4, 4), torch.randn(1, 1, 1, 4), torch.randn(1, 1, 100_000, 4)],
        [["aten::_scaled_dot_product_flash_attention_for_cpu",
          [Slot(0), Slot(1), Slot(2)], {}, 2]],
    ),
    "ctc_loss: a target past the classes (segfault)": (
        [torch.randn(5, 1, 3).log_softmax(2), torch.tensor([[2, 100_000, 1]])],
        [["aten::_ctc_loss", [Slot(0), Slot(1), [5], [3], 0, False], {}, 2]],
    ),
    "ctc_loss: no input steps (uninitialised log_alpha)": (
        [torch.randn(5, 1, 3).log_softmax(2), torch.tensor([[1, 2, 1]])],
        [["aten::_ctc_loss", [Slot(0), Slot(1), [0], [3], 0, False], {}, 2]],
    ),
    "ctc_loss_backward: a short log_alpha (heap corruption)": (
        [torch.ones(2), _lp, _targets, _nll, _alpha[:, :1, :1].contiguous()],
        [["aten::_ctc_loss_backward",
          [Slot(0), Slot(1), Slot(2), [6, 6], [3, 3], Slot(3), Slot(4), 0, False], {}, 1]],
    ),
    "cdist_backward: a short gradient (read)": (
        [torch.ones(1), torch.randn(3, 4), torch.randn(5, 4)],
        [["aten::_cdist_backward", [Slot(0), Slot(1), Slot(2), 1.0, Slot(0)], {}, 1]],
    ),
    "unfold_backward: a short gradient (read)": (
        [torch.ones(4)],
        [["aten::unfold_backward", [Slot(0), [100], 0, 4, 1], {}, 1]],
    ),
    "multi_margin_loss_backward: a short gradient (read)": (
        [torch.ones(1), torch.randn(2, 4), torch.tensor([1, 2])],
        [["aten::multi_margin_loss_backward", [Slot(0), Slot(1), Slot(2), 1, 1, None, 0], {}, 1]],
    ),
    "grid_sampler_2d: a mode that names none (uninitialised result)": (
        [torch.randn(1, 1, 4, 4), torch.rand(1, 8, 8, 2)],
        [["aten::grid_sampler_2d", [Slot(0), Slot(1), 7, 0, False], {}, 1]],
    ),
    "mkldnn_rnn_layer: one number for each state (abort)": (
        [torch.randn(3, 2, 4), torch.randn(20, 4), torch.randn(20, 5), torch.randn(20),
         torch.ones(1)],
        [["aten::mkldnn_rnn_layer",
          [Slot(0), Slot(1), Slot(2), Slot(3), Slot(3), Slot(4), Slot(4), False, [], 2, 5, 1,
           True, False, False, False], {}, 4]],
    ),
    # A second review, of the checks above:
    "mkldnn_rnn_layer: states for a batch-first input's batch (heap corruption)": (
        [torch.randn(2, 7, 3), torch.randn(16, 3), torch.randn(16, 4), torch.randn(16),
         torch.zeros(1, 2, 4)],
        [["aten::mkldnn_rnn_layer",
          [Slot(0), Slot(1), Slot(2), Slot(3), Slot(3), Slot(4), Slot(4), False, [], 2, 4, 1,
           True, False, True, False], {}, 4]],
    ),
    "mkldnn_rnn_layer_backward: an empty workspace (segfault)": (
        [_rnn_in, *_rnn_w, _rnn_h, _rnn_h, *_rnn_out[:3], torch.empty(0, dtype=torch.uint8)],
        [["aten::mkldnn_rnn_layer_backward",
          [Slot(0), Slot(1), Slot(2), Slot(3), Slot(4), Slot(5), Slot(6), Slot(7), Slot(8),
           Slot(9), Slot(7), Slot(8), Slot(9), False, 2, 4, 1, True, True, False, [], False,
           Slot(10)], {}, 7]],
    ),
    "mkldnn_rnn_layer_backward: one byte of workspace (heap corruption)": (
        [_rnn_in, *_rnn_w, _rnn_h, _rnn_h, *_rnn_out[:3], _rnn_out[3][:1].clone()],
        [["aten::mkldnn_rnn_layer_backward",
          [Slot(0), Slot(1), Slot(2), Slot(3), Slot(4), Slot(5), Slot(6), Slot(7), Slot(8),
           Slot(9), Slot(7), Slot(8), Slot(9), False, 2, 4, 1, True, True, False, [], False,
           Slot(10)], {}, 7]],
    ),
    "mkldnn_rnn_layer_backward: a bfloat16 gradient read as float32 (read)": (
        [_rnn_in, *_rnn_w, _rnn_h, _rnn_h, *_rnn_out[:3], _rnn_out[3],
         _rnn_out[0].to(torch.bfloat16)],
        [["aten::mkldnn_rnn_layer_backward",
          [Slot(0), Slot(1), Slot(2), Slot(3), Slot(4), Slot(5), Slot(6), Slot(7), Slot(8),
           Slot(9), Slot(11), Slot(8), Slot(9), False, 2, 4, 1, True, True, False, [], False,
           Slot(10)], {}, 7]],
    ),
    "segment_reduce: fewer rows of lengths than data (segfault)": (
        [torch.randn(3, 4), torch.tensor([[2, 2]])],
        [["aten::segment_reduce", [Slot(0), "sum"], {"lengths": Slot(1), "axis": 1}, 1]],
    ),
    "segment_reduce_backward: fewer segments in output than lengths (read)": (
        [torch.ones(1), torch.randn(1), torch.randn(6), torch.ones(6, dtype=LONG)],
        [["aten::_segment_reduce_backward", [Slot(0), Slot(1), Slot(2), "sum"],
          {"lengths": Slot(3)}, 1]],
    ),
    "ctc_loss_backward: a blank past the classes (segfault)": (
        [torch.ones(2), _lp, _targets, _nll, _alpha],
        [["aten::_ctc_loss_backward",
          [Slot(0), Slot(1), Slot(2), [6, 6], [3, 3], Slot(3), Slot(4), 10**7, False], {}, 1]],
    ),
    "ctc_loss_backward: fewer target rows than the batch (segfault)": (
        [torch.ones(2), _lp, torch.ones(1, 3, dtype=LONG), _nll, _alpha],
        [["aten::_ctc_loss_backward",
          [Slot(0), Slot(1), Slot(2), [6, 6], [3, 3], Slot(3), Slot(4), 0, False], {}, 1]],
    ),
    "native_group_norm_backward: N x C x HxW wrapping round (segfault)": (
        [torch.randn(2, 4, 3), torch.randn(2, 4, 3), torch.zeros(2, 2), torch.ones(2, 2)],
        [["aten::native_group_norm_backward",
          [Slot(0), Slot(1), Slot(2), Slot(3), None, 2, 4, 2**62 + 3, 2, [True, True, True]],
          {}, 3]],
    ),
    "native_batch_norm_backward: no statistics at all (segfault)": (
        [torch.randn(2, 3, 4), torch.empty(0)],
        [["aten::native_batch_norm_backward",
          [Slot(0), Slot(0), None, None, None, Slot(1), Slot(1), False, 1e-5,
           [True, True, True]], {}, 3]],
    ),
    "_embedding_bag: max of no bags, last offset included (segfault)": (
        [torch.randn(10, 4), torch.tensor([1, 2, 3]), torch.tensor([0])],
        [["aten::_embedding_bag", [Slot(0), Slot(1), Slot(2), False, 2, False, None, True], {},
          4]],
    ),
    "_log_softmax_backward_data: a short output (read)": (
        [torch.randn(2, 5), torch.zeros(2, 1)],
        [["aten::_log_softmax_backward_data", [Slot(0), Slot(1), 1, torch.float32], {}, 1]],
    ),
    "div: the least int64 over -1, truncated (SIGFPE: the process dies)": (
        [torch.tensor([-(2**63)]), torch.tensor([-1])],
        [["aten::div.Tensor_mode", [Slot(0), Slot(1)], {"rounding_mode": "trunc"}, 1]],
    ),
    "div_: the least int32 over an expanded -1, in place (SIGFPE)": (
        [torch.tensor([5, -(2**31)], dtype=INT), torch.tensor(-1, dtype=INT)],
        [["aten::div_.Tensor_mode", [Slot(0), Slot(1)], {"rounding_mode": "trunc"}, 1]],
    ),
    "div: -1 as a negated view of 1 (SIGFPE)": (
        [torch.tensor([-(2**31)] * 4, dtype=INT), torch.tensor([1] * 4, dtype=INT)],
        [["aten::_neg_view", [Slot(1)], {}, 1],
         ["aten::div.Tensor_mode", [Slot(0), Slot(2)], {"rounding_mode": "trunc"}, 1]],
    ),
    "div: an int64 0-dim divisor of 2**32 - 1, -1 in int32 (SIGFPE)": (
        [torch.tensor([-(2**31)] * 4, dtype=INT), torch.tensor(2**32 - 1)],
        [["aten::div.Tensor_mode", [Slot(0), Slot(1)], {"rounding_mode": "trunc"}, 1]],
    ),
    "div: an int64 0-dim dividend of 2**31, the least int32 (SIGFPE)": (
        [torch.tensor(2**31), torch.tensor([-1] * 4, dtype=INT)],
        [["aten::div.Tensor_mode", [Slot(0), Slot(1)], {"rounding_mode": "trunc"}, 1]],
    ),
    "div: a Python divisor of 2**32 - 1, -1 in int32 (SIGFPE)": (
        [torch.tensor([-(2**31)] * 4, dtype=INT)],
        [["aten::div.Tensor_mode", [Slot(0), 2**32 - 1], {"rounding_mode": "trunc"}, 1]],
    ),
    "lcm: an int64 0-dim 2**31, the least int32 (SIGFPE)": (
        [torch.tensor(2**31), torch.tensor([2**31 - 1], dtype=INT)],
        [["aten::lcm", [Slot(0), Slot(1)], {}, 1]],
    ),
    "grid_sampler_2d_backward: a finite grid that overflows in pixels (segfault)": (
        [torch.rand(1, 1, 3, 3), torch.rand(1, 1, 4, 4), torch.full((1, 3, 3, 2), 3.4e38)],
        [["aten::grid_sampler_2d_backward", [Slot(0), Slot(1), Slot(2), 0, 2, False,
          [True, True]], {}, 2]],
    ),
    "lcm: the least int64 and the greatest (SIGFPE: its gcd comes out -1)": (
        [torch.tensor([-(2**63)]), torch.tensor([2**63 - 1])],
        [["aten::lcm", [Slot(0), Slot(1)], {}, 1]],
    ),
    "lcm_: the least int32 and the greatest, in place (SIGFPE)": (
        [torch.tensor([-(2**31)], dtype=INT), torch.tensor([2**31 - 1], dtype=INT)],
        [["aten::lcm_", [Slot(0), Slot(1)], {}, 1]],
    ),
    "grid_sampler_2d_backward: a NaN grid, border padding (segfault)": (
        [torch.rand(1, 1, 3, 3), torch.rand(1, 1, 4, 4), torch.full((1, 3, 3, 2), float("nan"))],
        [["aten::grid_sampler_2d_backward", [Slot(0), Slot(1), Slot(2), 0, 1, False,
          [True, True]], {}, 2]],
    ),
    "grid_sampler_2d_backward: an infinite grid, reflection padding (segfault)": (
        [torch.rand(1, 1, 3, 3), torch.rand(1, 1, 4, 4), torch.full((1, 3, 3, 2), float("inf"))],
        [["aten::grid_sampler_2d_backward", [Slot(0), Slot(1), Slot(2), 0, 2, False,
          [True, True]], {}, 2]],
    ),
    "_upsample_bilinear2d_aa_backward: a scale of 1e-8 (gigabytes of weights)": (
        [torch.ones(1, 1, 4, 4)],
        [["aten::_upsample_bilinear2d_aa_backward", [Slot(0), [4, 4], [1, 1, 4, 4], False,
          1e-8, 1e-8], {}, 1]],
    ),
    "_embedding_bag_backward: no offset2bag, more bags than gradient rows (segfault)": (
        [torch.ones(1, 1), torch.zeros(1 << 20, dtype=LONG), torch.arange(1 << 20),
         torch.empty(0, dtype=LONG), torch.ones(1, dtype=LONG), torch.empty(0, dtype=LONG)],
        [["aten::_embedding_bag_backward", [Slot(0), Slot(1), Slot(2), Slot(3), Slot(4),
          Slot(5), 1, False, 0, False, None, -1], {}, 1]],
    ),
    "_embedding_bag_per_sample_weights_backward: no offset2bag, more bags (segfault)": (
        [torch.ones(1, 1), torch.rand(1, 1), torch.zeros(1 << 20, dtype=LONG),
         torch.arange(1 << 20), torch.empty(0, dtype=LONG)],
        [["aten::_embedding_bag_per_sample_weights_backward", [Slot(0), Slot(1), Slot(2),
          Slot(3), Slot(4), 0, -1], {}, 1]],
    ),
    "fractional_max_pool3d_backward: more planes in the input than the gradient (segfault)": (
        [torch.ones(1, 1, 1, 1, 1), torch.zeros(1 << 22, 1, 1, 1, 1),
         torch.zeros(1, 1, 1, 1, 1, dtype=LONG)],
        [["aten::fractional_max_pool3d_backward", [Slot(0), Slot(1), [1, 1, 1], [1, 1, 1],
          Slot(2)], {}, 1]],
    ),
    "fractional_max_pool2d_backward: more planes in the input than the gradient (read)": (
        [torch.ones(1, 1, 1, 1), torch.zeros(4096, 1, 1, 1), torch.zeros(1, 1, 1, 1, dtype=LONG)],
        [["aten::fractional_max_pool2d_backward", [Slot(0), Slot(1), [1, 1], [1, 1], Slot(2)],
          {}, 1]],
    ),
    "reflection_pad2d_backward: a padding past the input (heap corruption)": (
        [torch.randn(1, 1, 6, 4), torch.randn(1, 1, 4, 4)],
        [["aten::reflection_pad2d_backward", [Slot(0), Slot(1), [0, 0, 5, -3]], {}, 1]],
    ),
    "reflection_pad3d_backward: a padding past the input (heap corruption)": (
        [torch.randn(2, 3, 6, 6, 6), torch.randn(2, 3, 4, 4, 4)],
        [["aten::reflection_pad3d_backward", [Slot(0), Slot(1), [5, -3] * 3], {}, 1]],
    ),
    "avg_pool3d_backward: a smaller batch in the gradient than the input (read)": (
        [torch.ones(1, 1, 2, 2, 2), torch.zeros(4096, 1, 4, 4, 4)],
        [["aten::avg_pool3d_backward", [Slot(0), Slot(1), [2, 2, 2], [2, 2, 2], [0, 0, 0],
          False, True, None], {}, 1]],
    ),
    "convolution_backward: a 1-sample gradient for 65,536 inputs (segfault)": (
        [torch.zeros(1, 2, 6, 6, dtype=torch.float64), torch.zeros(65536, 1, 8, 8,
         dtype=torch.float64), torch.ones(2, 1, 3, 3, dtype=torch.float64)],
        [["aten::convolution_backward", [Slot(0), Slot(1), Slot(2), [2], [1, 1], [0, 0],
          [1, 1], False, [0, 0], 1, [True, True, True]], {}, 3]],
    ),
    "convolution_backward: a 3-D one with a smaller batch in the gradient (read)": (
        [torch.zeros(1, 2, 6, 6, 6, dtype=torch.float64), torch.zeros(4096, 1, 8, 8, 8,
         dtype=torch.float64), torch.ones(2, 1, 3, 3, 3, dtype=torch.float64)],
        [["aten::convolution_backward", [Slot(0), Slot(1), Slot(2), [2], [1, 1, 1], [0, 0, 0],
          [1, 1, 1], False, [0, 0, 0], 1, [True, True, True]], {}, 3]],
    ),
    "convolution_backward: a transposed stride of 2**32 + 1, read as 1 (segfault)": (
        [torch.ones(1, 1, 2), torch.ones(1, 1, 2), torch.ones(1, 1, 1)],
        [["aten::convolution_backward", [Slot(0), Slot(1), Slot(2), None, [2**32 + 1], [0],
          [1], True, [0], 1, [True, True, True]], {}, 3]],
    ),
    "convolution_backward: a transposed dilation of 2**32 + 1 (segfault)": (
        [torch.ones(1, 1, 5, 4), torch.ones(1, 1, 4, 4), torch.ones(1, 1, 2, 1)],
        [["aten::convolution_backward", [Slot(0), Slot(1), Slot(2), None, [1, 1], [0, 0],
          [2**32 + 1, 1], True, [0, 0], 1, [True, True, True]], {}, 3]],
    ),
    "convolution: a transposed output padding of 2**32, read as 0 (17 GB)": (
        [torch.ones(1, 1, 1, 1), torch.ones(1, 1, 1, 1)],
        [["aten::convolution", [Slot(0), Slot(1), None, [1, 1], [0, 0], [1, 1], True,
          [2**32, 0], 1], {}, 1]],
    ),
    "_fft_c2c: a dim past the input's (segfault)": (
        [torch.ones(4, dtype=torch.cfloat)],
        [["aten::_fft_c2c", [Slot(0), [65536], 0, True], {}, 1]],
    ),
    "_fft_r2c: a negative dim (segfault)": (
        [torch.ones(4)],
        [["aten::_fft_r2c", [Slot(0), [-(2**20)], 0, True], {}, 1]],
    ),
    "_fft_c2r: a dim of -2, written onto the stack (segfault)": (
        [torch.ones(4, dtype=torch.cfloat)],
        [["aten::_fft_c2r", [Slot(0), [-2], 0, 6], {}, 1]],
    ),
    "_pdist_forward: a 3-D input with no columns (segfault)": (
        [torch.rand(2, 3, 0)],
        [["aten::_pdist_forward", [Slot(0), 2.0], {}, 1]],
    ),
    "_pdist_backward: a 3-D input with no columns (segfault)": (
        [torch.rand(3), torch.rand(3, 2, 0), torch.rand(3)],
        [["aten::_pdist_backward", [Slot(0), Slot(1), 2.0, Slot(2)], {}, 1]],
    ),
}  # fmt: skip


def test_values_like_those_refused_run_as_in_torch_where_they_are_safe(local_grid):
    # The refusal is for the pairs that trap, not for a tensor that holds both values.
    x, y = torch.tensor([-(2**63), 7, -1]), torch.tensor([3, -1, -(2**63)])
    px, py = x.send(local_grid.workers[0]), y.send(local_grid.workers[0])
    got = torch.div(px, py, rounding_mode="trunc")
    assert torch.equal(got.get(), torch.div(x, y, rounding_mode="trunc"))
    big = torch.full((3000, 3000), 7, dtype=INT)  # past the pairs compared at once
    big[0, 0], small = -(2**31), torch.full((3000, 3000), 3, dtype=INT)
    small[5, 5] = -1
    got = torch.div(big.send(local_grid.workers[0]), small.send(local_grid.workers[0]),
                    rounding_mode="trunc")  # fmt: skip
    assert torch.equal(got.get(), torch.div(big, small, rounding_mode="trunc"))
    x, y = torch.tensor([12, -(2**63) + 1, 0]), torch.tensor([18, 2**63 - 1, 5])
    assert torch.equal(torch.lcm(x.send(local_grid.workers[0]), y).get(), torch.lcm(x, y))
    # An antialiased resize by a scale factor passes that scale to its kernels: allowed.
    image = torch.randn(1, 1, 9, 9, requires_grad=True)
    p = gg.send(image.detach(), local_grid.workers[0]).requires_grad_(True)
    got, want = (torch.nn.functional.interpolate(t, scale_factor=0.3, mode="bilinear",
                                                 antialias=True) for t in (p, image))  # fmt: skip
    (got_grad,) = torch.autograd.grad(got.sum(), p)
    (want_grad,) = torch.autograd.grad(want.sum(), image)
    assert torch.equal(got.get(), want.detach()) and torch.equal(got_grad.get(), want_grad)


def test_lstm_batch_first_trains_as_in_torch(local_grid):
    # torch passes batch_first=True to the layer kernel with the input already transposed
    # to (steps, batch, features), which the kernel reads whatever batch_first says.
    torch.manual_seed(0)
    lstm = torch.nn.LSTM(4, 3, num_layers=2, bidirectional=True, batch_first=True)
    x = torch.randn(2, 5, 4, requires_grad=True)
    out, (h, c) = lstm(x)
    (out.sum() + h.sum() + c.sum()).backward()
    remote = copy.deepcopy(lstm).send(local_grid.workers[0])
    remote.zero_grad()
    px = x.detach().send(local_grid.workers[1]).requires_grad_()
    got, (gh, gc) = remote(px)
    (got.sum() + gh.sum() + gc.sum()).backward()
    assert got.shape == out.shape == (2, 5, 6)
    torch.testing.assert_close(got.get(), out.detach())
    torch.testing.assert_close(px.grad.get(), x.grad)
    for p, want in zip(remote.parameters(), lstm.parameters()):
        torch.testing.assert_close(p.grad.get(), want.grad)


@pytest.mark.parametrize("case", list(CASES), ids=lambda c: c.split(":")[0] + c.split(":")[1][:12])
def test_arguments_a_kernel_would_index_past_are_refused_before_it_runs(case):
    inputs, steps = CASES[case]
    with gg.local_grid(1) as grid:
        peer = Peer(grid)
        put = {"kind": "put", "values": [[100 + i, t] for i, t in enumerate(inputs)]}
        assert peer.request("w0", put)["ok"]
        calls, slot = [], len(inputs)
        for op, args, kwargs, n_outs in steps:
            calls.append(hostile.call(op, args, list(range(slot, slot + n_outs)), kwargs))
            slot += n_outs
        slots = [100 + i for i in range(len(inputs))] + [200 + i for i in range(slot)]
        reply = peer.request("w0", hostile.run(calls, slots))
        assert not reply["ok"] and reply["error"]["message"], reply
        assert peer.request("w0", {"kind": "ping"})["ok"]  # the worker keeps serving
    # Refused by the op's own check, naming why (the worker may refuse a call before that,
    # where the op's meta kernel refuses it: limits.op_footprint)
    op, args, kwargs = _last_call(inputs, steps)
    with pytest.raises(KernelArgumentRefused):
        checked_arguments(op, args, kwargs)


def _last_call(inputs: list, steps: list) -> tuple:
    """The last step's (op, args, kwargs) on real tensors; the steps before it (a permute, an
    RNN's forward: what sets up a layout) are run here, as torch runs them."""
    values = list(inputs)

    def real(a):
        if type(a) is Slot:
            return values[a.index]
        return [real(x) for x in a] if type(a) is list else a

    def call(name: str, args: list, kwargs: dict) -> tuple:
        return resolve(name), [real(a) for a in args], {k: real(v) for k, v in kwargs.items()}

    for name, args, kwargs, n_outs in steps[:-1]:
        op, args, kwargs = call(name, args, kwargs)
        result = op(*args, **kwargs)
        values += (list(result) if isinstance(result, (tuple, list)) else [result])[:n_outs]
    op, args, kwargs = call(*steps[-1][:3])
    return op, args, kwargs
