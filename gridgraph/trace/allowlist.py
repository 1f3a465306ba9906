"""The op vocabulary of the graph: the ATen overloads a worker will run, by name, by category.

Policy: an allowlist. A worker runs an op only if its overload name is listed here
(`resolve`, which a worker calls on every op of a program it receives); the recorder
(trace/record.py) asks `refusal` before it records a call, and decomposes any other op into
listed ones with PyTorch's own decompositions (torch._decomp), or refuses it at the call.

The list is the ops that reach `__torch_dispatch__` when PyTorch's OpInfo samples run
(`scripts/collect_dispatch_ops.py`), reviewed by hand into CATEGORIES; REFUSED says why
each op left out was. Never listed: private kernels that skip checks, sparse and nested
constructors, `_test_*` ops, ops on process state, `set_`, `out=` forms (recorded as their
functional op and a `copy_`), files and raw memory. The worker adds three properties
(exec/worker/ops.py): every result is checked against its storage's bounds, the results of
the ops in UNINITIALIZED are zero-filled, and the arguments of kernels that index with them
unchecked are checked first (exec/safety/kernel_checks.py).

To add an op: check that it validates its arguments, does not reach outside its tensors'
storage or the process's tensor math, then list it under its category (a kernel that trusts
its arguments needs a check in kernel_checks.py).
"""

from __future__ import annotations

import re
from functools import cache

import torch

from gridgraph.trace.graph import op_name

CATEGORIES: dict[str, tuple[str, ...]] = {
    # elementwise math, comparisons and activations, out of place and in place
    "pointwise": (
        "_conj_physical", "abs", "abs_", "acos", "acos_", "acosh", "acosh_", "add.Scalar",
        "add.Tensor", "add_.Scalar", "add_.Tensor", "addcdiv", "addcdiv_", "addcmul", "addcmul_",
        "angle", "asin", "asin_", "asinh", "asinh_", "atan", "atan2", "atan2_", "atan_", "atanh",
        "atanh_", "bitwise_and.Tensor", "bitwise_and_.Tensor", "bitwise_left_shift.Tensor",
        "_foreach_add_.Scalar", "bitwise_left_shift_.Tensor", "bitwise_not", "bitwise_not_",
        "bitwise_or.Tensor",
        "bitwise_or_.Tensor", "bitwise_right_shift.Tensor", "bitwise_right_shift_.Tensor",
        "bitwise_xor.Tensor", "bitwise_xor_.Tensor", "ceil", "ceil_", "celu", "celu_", "clamp",
        "clamp.Tensor", "clamp_", "clamp_.Tensor", "clamp_max.Tensor", "clamp_max_.Tensor",
        "clamp_min", "clamp_min.Tensor", "clamp_min_", "clamp_min_.Tensor", "clone",
        "conj_physical_", "copysign.Scalar", "copysign.Tensor", "copysign_.Scalar",
        "copysign_.Tensor", "cos", "cos_", "cosh", "cosh_", "deg2rad", "deg2rad_", "digamma",
        "digamma_", "div.Scalar", "div.Tensor", "div.Tensor_mode", "div_.Scalar", "div_.Tensor",
        "div_.Tensor_mode", "elu", "elu_", "eq.Scalar", "eq.Tensor", "eq_.Tensor", "equal", "erf",
        "erf_", "erfc", "erfc_", "erfinv", "erfinv_", "exp", "exp2", "exp2_", "exp_", "expm1",
        "expm1_", "floor", "floor_", "floor_divide", "fmax", "fmin", "fmod.Tensor", "fmod_.Tensor",
        "frac", "frac_", "frexp.Tensor", "gcd", "gcd_", "ge.Scalar", "ge.Tensor", "ge_.Tensor",
        "gelu", "gt.Scalar", "gt.Tensor", "gt_.Tensor", "hardshrink", "hardsigmoid", "hardsigmoid_",
        "hardtanh", "heaviside", "heaviside_", "hypot", "hypot_", "i0", "i0_", "igamma", "igamma_",
        "igammac", "igammac_", "isinf", "isnan", "isneginf", "isposinf", "lcm", "lcm_",
        "ldexp.Tensor", "ldexp_", "le.Scalar", "le.Tensor", "le_.Tensor", "leaky_relu",
        "leaky_relu_", "lerp.Scalar", "lerp.Tensor", "lerp_.Scalar", "lerp_.Tensor", "lgamma",
        "lgamma_", "log", "log10", "log10_", "log1p", "log1p_", "log2", "log2_", "log_",
        "logaddexp", "logaddexp2", "logical_and", "logical_and_", "logical_not", "logical_not_",
        "logical_or", "logical_or_", "logical_xor", "logical_xor_", "logit", "logit_", "lt.Scalar",
        "lt.Tensor", "lt_.Tensor", "masked_fill.Scalar", "maximum", "minimum", "mish", "mish_",
        "mul.Scalar", "mul.Tensor", "mul_.Scalar", "mul_.Tensor", "mvlgamma", "mvlgamma_",
        "nan_to_num", "nan_to_num_", "ne.Scalar", "ne.Tensor", "ne_.Tensor", "neg", "neg_",
        "nextafter", "nextafter_", "polygamma", "polygamma_", "pow.Scalar", "pow.Tensor_Scalar",
        "pow.Tensor_Tensor", "pow_.Scalar", "pow_.Tensor", "rad2deg", "rad2deg_", "reciprocal",
        "reciprocal_", "relu", "relu_", "remainder.Scalar", "remainder.Tensor", "remainder_.Tensor",
        "round", "round.decimals", "round_", "round_.decimals", "rsqrt", "rsqrt_", "rsub.Scalar",
        "rsub.Tensor", "sgn", "sgn_", "sigmoid", "sigmoid_", "sign", "sign_", "signbit", "silu",
        "silu_", "sin", "sin_", "sinc", "sinc_", "sinh", "sinh_", "softplus", "softshrink",
        "special_airy_ai", "special_bessel_j0", "special_bessel_j1", "special_bessel_y0",
        "special_bessel_y1", "special_chebyshev_polynomial_t", "special_chebyshev_polynomial_u",
        "special_chebyshev_polynomial_v", "special_chebyshev_polynomial_w", "special_entr",
        "special_erfcx", "special_hermite_polynomial_h", "special_hermite_polynomial_he",
        "special_i0e", "special_i1", "special_i1e", "special_laguerre_polynomial_l",
        "special_legendre_polynomial_p", "special_log_ndtr", "special_modified_bessel_i0",
        "special_modified_bessel_i1", "special_modified_bessel_k0", "special_modified_bessel_k1",
        "special_ndtri", "special_scaled_modified_bessel_k0", "special_scaled_modified_bessel_k1",
        "special_shifted_chebyshev_polynomial_t", "special_shifted_chebyshev_polynomial_u",
        "special_shifted_chebyshev_polynomial_v", "special_shifted_chebyshev_polynomial_w",
        "special_spherical_bessel_j0", "special_xlog1py", "special_zeta", "sqrt", "sqrt_",
        "sub.Scalar", "sub.Tensor", "sub_.Tensor", "tan", "tan_", "tanh", "tanh_", "threshold",
        "threshold_", "trunc", "trunc_", "where.self", "xlogy.Tensor", "xlogy_.Tensor"
    ),
    # sums, means, norms, extrema, cumulative ops
    "reductions and scans": (
        "all", "all.dim", "all.dims", "allclose", "amax", "amin", "aminmax", "any", "any.dim",
        "any.dims", "argmax", "argmin", "count_nonzero", "count_nonzero.dim_IntList", "cummax",
        "cummin", "cumprod", "cumprod_", "cumsum", "cumsum_", "hash_tensor", "logcumsumexp",
        "logsumexp", "max", "max.dim", "mean", "mean.dim", "min", "min.dim", "nansum",
        "norm.ScalarOpt_dim", "prod", "prod.dim_int", "renorm", "renorm_", "segment_reduce",
        "std.correction", "std_mean.correction", "sum", "sum.dim_IntList", "var.correction",
        "var_mean.correction"
    ),
    # matrix products, decompositions and solvers
    "linear algebra": (
        "_cdist_forward", "_euclidean_dist", "_linalg_check_errors", "_linalg_det", "_linalg_eigh",
        "_linalg_slogdet", "_linalg_solve_ex", "_linalg_svd", "_pdist_forward", "_trilinear",
        "addbmm", "addbmm_", "addmm", "addmm_", "addmv", "addmv_", "addr", "addr_", "baddbmm",
        "baddbmm_", "bmm", "cholesky_inverse", "cholesky_solve", "dist", "dot", "geqrf",
        "linalg_cholesky_ex", "linalg_cross", "linalg_eig", "linalg_householder_product",
        "linalg_inv_ex", "linalg_ldl_factor_ex", "linalg_ldl_solve", "linalg_lstsq", "linalg_lu",
        "linalg_lu_factor_ex", "linalg_lu_solve", "linalg_matrix_exp", "linalg_matrix_sqrth",
        "linalg_pinv.atol_rtol_tensor", "linalg_polar", "linalg_qr", "linalg_solve_triangular",
        "linalg_vector_norm", "lu_unpack", "mm", "mv", "ormqr", "trace", "triangular_solve", "vdot"
    ),
    # results that share their input's storage (checked against its bounds)
    "views": (
        "_conj", "_neg_view", "_unsafe_view", "alias", "as_strided", "detach", "diagonal", "expand",
        "permute",
        "select.int", "slice.Tensor", "split.Tensor", "split_with_sizes", "squeeze", "squeeze.dim",
        "squeeze.dims", "t", "transpose.int", "unbind.int", "unfold", "unsqueeze", "view",
        "view_as_complex", "view_as_real"
    ),
    # in place, a tensor's layout: its own dimensions reordered, dropped or added where of
    # size 1 (the plan transposes around transfers with these), set at will (as_strided_) or
    # resized (resize_, resize_as_): as_strided_ is checked to stay inside the storage
    # before it runs, and memory a resize grows into is zeroed
    "layout in place": (
        "as_strided_", "resize_", "resize_as_", "squeeze_", "squeeze_.dim", "squeeze_.dims", "t_",
        "transpose_", "unsqueeze_"
    ),
    # copies, concatenation, reordering, triangles
    "shape and copy": (
        "_chunk_cat", "_to_copy", "alias_copy", "as_strided_copy", "block_diag", "cat", "copy_",
        "diag_embed", "diagonal_copy", "expand_copy", "flip", "floor_divide_.Tensor", "narrow_copy",
        "permute_copy", "repeat", "repeat_interleave.Tensor", "roll", "rot90",
        "split_with_sizes_copy", "squeeze_copy", "squeeze_copy.dim", "stack", "t_copy",
        "transpose_copy.int", "tril", "tril_", "triu", "triu_", "unbind_copy.int", "unfold_copy",
        "unsafe_split.Tensor", "unsqueeze_copy", "view_copy"
    ),
    # gather/scatter/index ops (PyTorch checks every index)
    "indexing": (
        "as_strided_scatter", "diagonal_scatter", "gather", "index.Tensor", "index_add",
        "index_add_", "index_copy", "index_copy_", "index_fill.int_Scalar", "index_fill.int_Tensor",
        "index_fill_.int_Scalar", "index_fill_.int_Tensor", "index_put", "index_put_",
        "index_reduce", "index_reduce_", "index_select", "masked_fill.Tensor",
        "masked_fill_.Scalar", "masked_fill_.Tensor", "masked_scatter", "masked_scatter_", "put",
        "put_", "scatter.reduce", "scatter.src", "scatter.value", "scatter.value_reduce",
        "scatter_.reduce", "scatter_.src", "scatter_.value", "scatter_.value_reduce", "scatter_add",
        "scatter_add_", "scatter_reduce.two", "scatter_reduce_.two", "select_scatter",
        "slice_scatter", "take"
    ),
    # outputs whose shape depends on values (run eagerly)
    "sorting, searching, data-dependent": (
        "_histogramdd_bin_edges", "_histogramdd_from_bin_cts", "_histogramdd_from_bin_tensors",
        "_unique", "_unique2", "bincount", "bucketize.Tensor", "histc", "histogram.bin_ct",
        "histogram.bins_tensor", "isin.Tensor_Tensor", "kthvalue", "masked_select", "median",
        "median.dim", "mode", "nanmedian", "nanmedian.dim", "nonzero", "nonzero_static",
        "searchsorted.Scalar", "searchsorted.Tensor", "sort", "sort.stable", "topk",
        "unique_consecutive", "unique_dim"
    ),
    # new tensors shaped after an input (uninitialised ones are zero-filled)
    "creation from a tensor": (
        "complex", "empty_like", "fill.Scalar", "fill.Tensor", "fill_.Scalar", "fill_.Tensor",
        "full_like",
        "linspace.Scalar_Tensor", "linspace.Tensor_Scalar", "linspace.Tensor_Tensor",
        "logspace.Scalar_Tensor", "logspace.Tensor_Scalar", "logspace.Tensor_Tensor", "new_empty",
        "new_empty_strided", "new_full", "new_ones", "new_zeros", "ones_like", "polar", "zero_",
        "zeros_like"
    ),
    # draw from the client's own random stream
    "random": (
        "_scaled_dot_product_flash_attention_for_cpu", "bernoulli", "bernoulli_.float", "cauchy_",
        "exponential_", "geometric_", "log_normal_", "multinomial", "native_dropout",
        "normal.Tensor_Tensor", "normal.Tensor_float", "normal_", "rand_like", "randint_like",
        "randint_like.low_dtype", "randn_like", "rrelu_with_noise", "rrelu_with_noise_", "uniform_"
    ),
    # convolution, pooling, padding, upsampling, normalisation, losses
    "neural network": (
        "_adaptive_avg_pool2d", "_adaptive_avg_pool3d", "_batch_norm_with_update", "_ctc_loss",
        "_ctc_loss.Tensor", "_embedding_bag", "_embedding_bag_forward_only", "_log_softmax",
        "_native_batch_norm_legit",
        "_native_batch_norm_legit.no_stats", "_prelu_kernel", "_safe_softmax", "_softmax",
        "_upsample_bilinear2d_aa", "_upsample_nearest_exact1d", "_upsample_nearest_exact2d",
        "_upsample_nearest_exact3d", "adaptive_max_pool2d", "adaptive_max_pool3d", "avg_pool2d",
        "avg_pool3d", "binary_cross_entropy", "binary_cross_entropy_with_logits", "channel_shuffle",
        "col2im", "constant_pad_nd", "convolution", "embedding", "embedding_renorm_",
        "fractional_max_pool2d",
        "fractional_max_pool3d", "glu", "grid_sampler_2d", "grid_sampler_3d", "hardswish",
        "huber_loss", "im2col", "log_sigmoid_forward", "max_pool2d_with_indices",
        "max_pool3d_with_indices", "max_unpool2d", "max_unpool3d", "mkldnn_rnn_layer", "mse_loss",
        "multi_margin_loss",
        "multilabel_margin_loss_forward", "native_batch_norm", "native_group_norm",
        "native_layer_norm", "nll_loss2d_forward", "nll_loss_forward", "pixel_shuffle",
        "pixel_unshuffle", "reflection_pad1d", "reflection_pad2d", "reflection_pad3d",
        "replication_pad1d", "replication_pad2d", "replication_pad3d", "smooth_l1_loss",
        "soft_margin_loss", "upsample_bicubic2d", "upsample_bilinear2d", "upsample_linear1d",
        "upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d", "upsample_trilinear3d"
    ),
    # gradient kernels autograd calls
    "backward": (
        "_adaptive_avg_pool2d_backward", "_adaptive_avg_pool3d_backward", "_cdist_backward",
        "_ctc_loss_backward", "_ctc_loss_backward.Tensor", "_embedding_bag_backward",
        "_embedding_bag_per_sample_weights_backward", "_log_softmax_backward_data",
        "_pdist_backward", "_prelu_kernel_backward",
        "_scaled_dot_product_flash_attention_for_cpu_backward", "_segment_reduce_backward",
        "_softmax_backward_data", "_upsample_bilinear2d_aa_backward",
        "_upsample_nearest_exact1d_backward", "_upsample_nearest_exact2d_backward",
        "_upsample_nearest_exact3d_backward", "adaptive_max_pool2d_backward",
        "adaptive_max_pool3d_backward", "avg_pool2d_backward", "avg_pool3d_backward",
        "batch_norm_backward", "binary_cross_entropy_backward", "convolution_backward",
        "diagonal_backward", "elu_backward", "embedding_dense_backward",
        "fractional_max_pool2d_backward", "fractional_max_pool3d_backward", "gelu_backward",
        "glu_backward", "grid_sampler_2d_backward", "grid_sampler_3d_backward",
        "hardshrink_backward", "hardsigmoid_backward", "hardswish_backward", "hardtanh_backward",
        "huber_loss_backward", "leaky_relu_backward", "log_sigmoid_backward", "logit_backward",
        "masked_scatter_backward", "max_pool2d_with_indices_backward", "mkldnn_rnn_layer_backward",
        "max_pool3d_with_indices_backward", "mish_backward", "mse_loss_backward",
        "multi_margin_loss_backward", "multilabel_margin_loss_backward",
        "native_batch_norm_backward", "native_dropout_backward", "native_group_norm_backward",
        "native_layer_norm_backward", "nll_loss2d_backward", "nll_loss_backward",
        "reflection_pad1d_backward", "reflection_pad2d_backward", "reflection_pad3d_backward",
        "replication_pad1d_backward", "replication_pad2d_backward", "replication_pad3d_backward",
        "rrelu_with_noise_backward", "select_backward", "sigmoid_backward", "silu_backward",
        "slice_backward", "smooth_l1_loss_backward", "soft_margin_loss_backward",
        "softplus_backward", "softshrink_backward", "tanh_backward", "threshold_backward",
        "unfold_backward", "upsample_bicubic2d_backward", "upsample_bilinear2d_backward",
        "upsample_linear1d_backward", "upsample_nearest1d_backward", "upsample_nearest2d_backward",
        "upsample_nearest3d_backward", "upsample_trilinear3d_backward"
    ),
    # discrete Fourier transforms
    "fft": (
        "_fft_c2c", "_fft_c2r", "_fft_r2c"
    ),
}  # fmt: skip

# Reached by PyTorch's own OpInfo samples, reviewed and refused, with the reason. Never
# listed either: private kernels that skip checks (`_unsafe_*` other than `_unsafe_view`,
# `_reshape_alias`), `_test_*` ops, `manual_seed`/`seed`/`set_num_threads`, `from_file`,
# `data_ptr`. The private overloads that are listed (`_softmax`, `_to_copy`, `_fft_c2c`,
# `_linalg_svd`, ...) are the kernels behind public functions, each reviewed to check its
# arguments as its public function does. Added after review, though OpInfo's samples do not
# reach them: `native_dropout` (nn.Dropout's kernel: decomposed, its random stream would
# differ from torch's) and `_embedding_bag_forward_only` (embedding_bag without autograd).
REFUSED: dict[str, tuple[str, ...]] = {
    "unsafe: skips the bounds checks on its indices": (
        "_unsafe_masked_index", "_unsafe_masked_index_put_accumulate"
    ),
    "sparse layouts (sparse constructors and kernels)": (
        "_sparse_mm_reduce_impl", "_sparse_mm_reduce_impl_backward", "_to_sparse",
        "_to_sparse.sparse_dim", "sparse_mask", "sparse_sampled_addmm"
    ),
    "a ZeroTensor: a tensor with no storage that kernels must special-case": (
        "_efficientzerotensor",
    ),
    "out= forms: they resize the tensor they write (recorded as the op and a copy_)": (
        "addmm.out", "amax.out", "div.out", "mm.out", "mul.out"
    ),
    "runs on the client: .item() and friends are sync points, lift_fresh only marks constants": (
        "_local_scalar_dense", "lift_fresh"
    ),
    "factories with no tensor input: never recorded on a pointer": (
        "arange", "arange.start", "arange.start_step", "empty.memory_format", "empty_permuted",
        "empty_strided", "eye", "eye.m", "full", "linspace", "logspace", "normal.float_float",
        "ones", "rand", "randint", "randint.low", "randn", "scalar_tensor", "tril_indices",
        "triu_indices", "zeros"
    ),
}  # fmt: skip

# Ops whose result holds uninitialised memory: the worker zero-fills it before anyone reads it.
UNINITIALIZED = frozenset({"empty_like", "new_empty", "new_empty_strided"})

ALLOWED: frozenset[str] = frozenset(
    f"aten::{name}" for names in CATEGORIES.values() for name in names
)


def allowed(name: str) -> bool:
    """Whether a worker runs the ATen overload called `name` ('aten::add.Tensor')."""
    return name in ALLOWED


def category(name: str) -> str | None:
    """The category that lists `name` ('aten::add.Tensor' -> 'pointwise'), if any."""
    short = name.removeprefix("aten::")
    return next((c for c, names in CATEGORIES.items() if short in names), None)


_NAME = re.compile(r"^aten::([a-z_][a-z0-9_]*)(?:\.([a-zA-Z0-9_]+))?$")
# Ops that make or take sparse, mkldnn or nested tensors: workers hold, compute and send
# dense strided tensors only (the wire format carries nothing else).
_OTHER_LAYOUTS = re.compile(r"^aten::(\w*sparse\w*|to_mkldnn|\w*nested\w*)(\.|$)")


class OpRefused(ValueError):
    """An op name a worker will not run."""


@cache
def resolve(name: str) -> torch._ops.OpOverload:
    """The ATen overload called `name` ('aten::add.Tensor'), if it is on the allowlist."""
    m = _NAME.match(name) if isinstance(name, str) else None
    if m is None:
        raise OpRefused(f"{name!r} is not an ATen op name")
    base, overload = m.group(1), m.group(2) or "default"
    canonical = f"aten::{base}" + ("" if overload == "default" else f".{overload}")
    if canonical not in ALLOWED:
        raise OpRefused(
            f"{canonical} is not on the workers' op allowlist (gridgraph/trace/allowlist.py)"
        )
    return getattr(getattr(torch.ops.aten, base), overload)


@cache
def refusal(op: torch._ops.OpOverload) -> str | None:
    """Why workers would not run `op` (not on the allowlist, or a layout other than
    strided), or None when they run it: the recorder asks before it records a call."""
    name = op_name(op)
    if _OTHER_LAYOUTS.match(name):
        return "only dense (strided) tensors are supported"
    try:
        resolve(name)
    except OpRefused as e:
        return str(e)
    return None
