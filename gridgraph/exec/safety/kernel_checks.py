"""Checks for the arguments of kernels that trust them: run before such an op, on a worker.

Threat model: a client names any allowed op with tensors of its making. Most ATen CPU kernels
check their arguments; the ones listed here index memory with what they are given, unchecked,
because in torch those arguments come from their own forward op (an index tensor, a saved
mean, a log_alpha) or a module that sized them. Crafted, they read or wrote past their
tensors: a crash of the worker, heap corruption, or another client's bytes in a result
(found by adversarial review, each with a repro; see tests/exec/worker/test_attacks.py).

Policy, per op (`CHECKS`): the integer tensors an op indexes with are made contiguous (an
expanded one was read as if it were) and checked to lie within what they index; tensors a
kernel reads as if shaped by its forward are checked to be so shaped; mode numbers are
checked to name a mode; values a kernel cannot take without trapping (a truncated integer
division) or without allocating by them (an antialiased resize's scales) are refused. A
failed check raises `KernelArgumentRefused` before the op runs,
so it changes nothing. What these cost: a min and a max over index tensors, a few shape
comparisons.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch

from gridgraph.exec.safety.arguments import Arg, argument_reader, stored_magnitude, stored_values


class KernelArgumentRefused(ValueError):
    """An op's arguments that its kernel would index or read past."""


def checked_arguments(op: torch._ops.OpOverload, args: list, kwargs: dict) -> tuple[list, dict]:
    """`op`'s arguments checked (`CHECKS`), its integer tensors made contiguous (all its
    tensors, for the backward kernels in `READ_AS_CONTIGUOUS`, which write none; none, for
    the ops in `VALUES_ONLY`)."""
    name = op._schema.name
    if name not in VALUES_ONLY:
        every = name in READ_AS_CONTIGUOUS
        args = [_contiguous(a, every) for a in args]
        kwargs = {k: _contiguous(v, every) for k, v in kwargs.items()}
    CHECKS[name](argument_reader(op, args, kwargs))
    return args, kwargs


def _contiguous(a: Any, every: bool) -> Any:
    if isinstance(a, torch.Tensor) and (every or not (a.is_floating_point() or a.is_complex())):
        return a.contiguous()
    if isinstance(a, list):
        return [_contiguous(x, every) for x in a]
    return a


# What an argument typed as one of these enums must be (an int is taken as its number: -2
# as a dtype segfaulted full_like's meta run, before any check of ours).
_ENUMS = {"ScalarType": torch.dtype, "Layout": torch.layout, "MemoryFormat": torch.memory_format}


def check_enum_arguments(op: torch._ops.OpOverload, args: list, kwargs: dict) -> None:
    """Refuse a dtype, layout or memory format given as a number: the worker calls this
    before an op's first (meta) run."""
    arg = argument_reader(op, args, kwargs)
    for name, kind in _enum_arguments(op):
        value = arg(name)
        if value is not None and not isinstance(value, kind):
            raise KernelArgumentRefused(f"{name} must be a {kind.__name__}, not {value!r}")


@functools.cache
def _enum_arguments(op: torch._ops.OpOverload) -> list[tuple[str, type]]:
    found = []
    for a in op._schema.arguments:
        kind = _ENUMS.get(str(a.real_type).removeprefix("Optional[").rstrip("]"))
        if kind is not None:
            found.append((a.name, kind))
    return found


# --- what the checks are made of --------------------------------------------------------------


def _in_range(t: Any, what: str, high: int, low: int = 0) -> None:
    """Refuse unless every element of `t` lies in [low, high)."""
    if not isinstance(t, torch.Tensor) or t.numel() == 0:
        return
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise KernelArgumentRefused(f"{what} must hold integer indices, not {t.dtype}")
    least, most = (int(x) for x in torch.aminmax(t))  # (one pass)
    if least < low or most >= high:
        raise KernelArgumentRefused(
            f"{what} holds an index out of range: {least}..{most}, where {low}..{high - 1} "
            "are allowed"
        )


def _shaped(t: Any, what: str, shape: Any) -> None:
    """Refuse unless `t` (a tensor, when given, or a shape) has exactly `shape`."""
    if t is None:
        return
    has = tuple(t.shape) if isinstance(t, torch.Tensor) else tuple(t)
    if has != tuple(shape):
        raise KernelArgumentRefused(f"{what} has shape {has}, not {tuple(shape)}")


def _sized(t: Any, what: str, numel: int) -> None:
    """Refuse unless tensor `t` (when given) has `numel` elements."""
    if isinstance(t, torch.Tensor) and t.numel() != numel:
        raise KernelArgumentRefused(f"{what} has {t.numel()} elements, not {numel}")


def _rows(t: Any) -> int:
    return t.shape[0] if isinstance(t, torch.Tensor) and t.dim() else 0


def _numel(t: Any) -> int:
    return t.numel() if isinstance(t, torch.Tensor) else 0


def _dense(t: Any, what: str) -> None:
    """Refuse a tensor a kernel writes as if contiguous (an expanded one wrote past it)."""
    if isinstance(t, torch.Tensor) and not t.is_contiguous():
        raise KernelArgumentRefused(f"{what} must be contiguous")


# --- embedding -------------------------------------------------------------------------------


def _bags(arg: Arg, indices_high: int, bags: int | None) -> None:
    """The indices, offsets, offset2bag, bag_size and per-sample weights of an embedding bag:
    `bags` rows in the gradient (None in the forward, which makes them)."""
    indices, offsets = arg("indices"), arg("offsets")
    _in_range(indices, "indices", indices_high)
    _in_range(offsets, "offsets", _numel(indices) + 1)
    if isinstance(offsets, torch.Tensor) and offsets.numel():
        if int(offsets.reshape(-1)[0]) != 0 or bool((offsets.diff() < 0).any()):
            raise KernelArgumentRefused("offsets must start at 0 and never decrease")
    if arg("include_last_offset") and _numel(offsets) < (2 if arg("mode") == 2 else 1):
        # (with one offset: no bags; sum and mean make none, max wrote before its output)
        raise KernelArgumentRefused(
            "include_last_offset needs two offsets in max mode, one otherwise"
        )
    weights = arg("per_sample_weights")
    if weights is not None and _numel(weights) != _numel(indices):
        raise KernelArgumentRefused("per_sample_weights must hold one weight per index")
    if bags is None:
        return
    offset2bag = arg("offset2bag")
    if 0 < _numel(offset2bag) < _numel(indices):  # (entries past the indices are not read)
        raise KernelArgumentRefused("offset2bag must name a bag for each index")
    _in_range(offset2bag, "offset2bag", bags)
    if _numel(offset2bag) == 0 and isinstance(offsets, torch.Tensor):
        # The backward kernels then rebuild offset2bag from offsets: one bag per offset
        # that starts within the indices, each a row of the gradient they read.
        if int((offsets < _numel(indices)).sum()) > bags:
            raise KernelArgumentRefused("offsets start more bags than grad has rows")
    if arg("bag_size") is not None and _numel(arg("bag_size")) < bags:
        raise KernelArgumentRefused("bag_size must hold a size for each bag")


def _embedding(arg: Arg) -> None:
    _in_range(arg("indices"), "indices", _rows(arg("weight")))


def _embedding_renorm(arg: Arg) -> None:
    _in_range(arg("indices"), "indices", _rows(arg("self")))


def _embedding_dense_backward(arg: Arg) -> None:
    _in_range(arg("indices"), "indices", arg("num_weights"))


def _embedding_bag(arg: Arg) -> None:
    _bags(arg, _rows(arg("weight")), None)


def _embedding_bag_backward(arg: Arg) -> None:
    _bags(arg, arg("num_weights"), _rows(arg("grad")))


def _per_sample_weights_backward(arg: Arg) -> None:
    _bags(arg, _rows(arg("weight")), _rows(arg("grad")))


# --- pooling backward, convolution -----------------------------------------------------------


def _pool_backward(spatial: int, has_indices: bool) -> Callable[[Arg], None]:
    """A max or adaptive pool's backward: its gradient shaped as its input in the leading
    dimensions (channels-last kernels read the channel count off the input), and its
    indices within a plane of its input, one per gradient element."""

    def check(arg: Arg) -> None:
        grad, input = arg("grad_output"), arg("self")
        if input.dim() < spatial or grad.dim() != input.dim():
            raise KernelArgumentRefused("grad_output must have its input's dimensions")
        _shaped(grad.shape[:-spatial], "grad_output's leading dimensions", input.shape[:-spatial])
        if has_indices:
            _shaped(arg("indices"), "indices", grad.shape)
            _in_range(arg("indices"), "indices", math.prod(input.shape[-spatial:]))

    return check


def _reflection_pad_backward(arg: Arg) -> None:
    """Each padding less than its dimension of the input, as the forward requires (the 2-D
    and 3-D backwards reflected past the input: heap corruption)."""
    input, pads = arg("self"), [int(p) for p in arg("padding")]
    for i in range(len(pads) // 2):  # (pairs from the last dimension back)
        size = input.shape[-1 - i] if input.dim() > i else 0
        if max(abs(pads[2 * i]), abs(pads[2 * i + 1])) >= size:
            raise KernelArgumentRefused(
                f"reflection padding {pads[2 * i : 2 * i + 2]} must be less than the input's "
                f"dimension of {size}"
            )


def _convolution(arg: Arg) -> None:
    """Strides, paddings, dilations, output paddings and groups under 2**31, and a transposed
    convolution's output padding under its stride or dilation, as the meta kernel requires:
    the slow transposed and 3-D CPU kernels check shapes with 32-bit copies of them (2**32 + 1
    read as 1) but compute with the full values (a stride of 2**32 + 1 segfaulted the
    backward; an output padding of 2**32 made the forward allocate 17 GB). The meta kernel
    refuses these too, which now refuses the call first (limits.op_footprint): this check
    stays as a second line."""
    lists = [arg(name) for name in ("stride", "padding", "dilation", "output_padding")]
    if (
        any(abs(int(v)) >= 2**31 for values in lists for v in values)
        or abs(int(arg("groups"))) >= 2**31
    ):
        raise KernelArgumentRefused("a convolution's parameters must each be under 2**31")
    if arg("transposed"):
        stride, _, dilation, output_padding = lists
        for s, d, p in zip(stride, dilation, output_padding):
            if int(p) >= max(int(s), int(d)):
                raise KernelArgumentRefused(
                    f"output padding {list(output_padding)} must be smaller than the stride "
                    f"{list(stride)} or the dilation {list(dilation)}"
                )


def _convolution_backward(arg: Arg) -> None:
    """As `_convolution`, and the gradient batched as the input: torch checks its other
    dimensions against the forward's output, not its first, and the slow kernels (float64;
    a float32 3-D convolution) read one gradient sample per input sample (a 1-sample
    gradient for 65,536 inputs read heap bytes into the result, then segfaulted)."""
    _convolution(arg)
    grad, input = arg("grad_output"), arg("input")
    if grad.dim() != input.dim() or grad.dim() == 0 or grad.shape[0] != input.shape[0]:
        raise KernelArgumentRefused(
            f"grad_output of shape {tuple(grad.shape)} must have the input's dimensions and "
            f"batch, as the input's shape {tuple(input.shape)} gives"
        )


# --- fft -------------------------------------------------------------------------------------


def _fft_dims(arg: Arg) -> None:
    """The dims of a raw FFT kernel as `torch.fft` passes them: non-empty, distinct, each in
    [0, ndim) (the kernels index sizes and strides with them unchecked: a dim of 65,536 or
    -2**20 segfaulted the worker); and for `_fft_c2r` a last dimension of last_dim_size // 2 + 1
    (it writes last_dim_size at dim[-1] into an array on the stack: a dim of -2 wrote before
    it, a segfault; -1 put stack words in the error). The normalization is any number, as in
    torch: it picks a scale (1, 1/sqrt(n) or 1/n), indexing nothing."""
    input, dims = arg("self"), arg("dim")
    ndim = input.dim()
    if not dims or len(set(dims)) != len(dims) or any(not 0 <= int(d) < ndim for d in dims):
        raise KernelArgumentRefused(
            f"FFT dims {list(dims)} must be distinct and each in 0..{ndim - 1}"
        )
    last = arg("last_dim_size")
    if last is not None and (int(last) < 1 or input.shape[dims[-1]] != int(last) // 2 + 1):
        raise KernelArgumentRefused(
            f"last_dim_size {last} must be at least 1, with the input's dimension {dims[-1]} "
            "of last_dim_size // 2 + 1"
        )


# --- normalisation ---------------------------------------------------------------------------

_PER_CHANNEL = ("weight", "bias", "running_mean", "running_var", "save_mean", "save_invstd",
                "save_var")  # fmt: skip


def _batch_norm(arg: Arg) -> None:
    """One value per channel in each per-channel tensor (the running stats are written
    there: a shorter one was written past; saved statistics may be empty out of training),
    and a gradient shaped as the input."""
    input = arg("input")
    if input.dim() < 2:
        raise KernelArgumentRefused("batch norm's input needs a channel dimension")
    training = arg("train", arg("update", arg("training", True)))
    for name in _PER_CHANNEL:
        t = arg(name)
        if not (name.startswith("save") and not training and _numel(t) == 0):
            _sized(t, name, input.shape[1])
        if name.startswith("running"):
            _dense(t, name)
    if arg("grad_out") is not None:  # (a backward reads the statistics it normalised by)
        _shaped(arg("grad_out"), "grad_out", input.shape)
        needed = ("save_mean", "save_invstd" if arg("save_invstd") is not None else "save_var")
        for name in needed if training else ("running_mean", "running_var"):
            if arg(name) is None:
                raise KernelArgumentRefused(f"{name} is needed {'in' if training else 'out of'} "
                                            "training")  # fmt: skip


def _group_norm(arg: Arg) -> None:
    """N, C, HxW and groups that describe the input (their product, which torch checks in
    int64, wrapped round to a small tensor's size), one value per channel or group."""
    n, c, hxw, group = (arg(name) for name in ("N", "C", "HxW", "group"))
    input = arg("input")
    if min(n, c, hxw) < 0 or group < 1 or c % group or n * c * hxw != input.numel():
        raise KernelArgumentRefused("N, C, HxW and group do not describe the input")
    _sized(arg("weight"), "weight", c)
    _sized(arg("bias"), "bias", c)
    if arg("grad_out") is not None:
        _shaped(arg("grad_out"), "grad_out", input.shape)
        _sized(arg("mean"), "mean", n * group)
        _sized(arg("rstd"), "rstd", n * group)


def _softmax_backward(arg: Arg) -> None:
    _shaped(arg("output"), "output", arg("grad_output").shape)


def _layer_norm_backward(arg: Arg) -> None:
    input, normalized = arg("input"), [int(n) for n in arg("normalized_shape")]
    groups = input.numel() // max(1, math.prod(normalized))
    _shaped(arg("grad_out"), "grad_out", input.shape)
    for name, numel in (("mean", groups), ("rstd", groups), ("weight", math.prod(normalized)),
                        ("bias", math.prod(normalized))):  # fmt: skip
        _sized(arg(name), name, numel)


# --- arithmetic ------------------------------------------------------------------------------

# Pairs of elements compared one to one at a time, at most (broadcast): a byte each.
PAIRS_COMPARED = 1 << 22


def _integer_division(arg: Arg) -> None:
    """No int32 or int64 minimum divided by -1 with rounding_mode="trunc": the quotient
    overflows and the CPU traps (SIGFPE: the whole worker process died). torch guards the
    other modes, and divides narrower integers in int."""
    if arg("rounding_mode") != "trunc":
        return
    dividend, divisor = arg("self"), arg("other")
    dtype = torch.result_type(dividend, divisor)
    if dtype not in (torch.int32, torch.int64):
        return
    least = torch.iinfo(dtype).min
    if not (_holds(dividend, least, dtype) and _holds(divisor, -1, dtype)):
        return
    if not _meet(dividend, least, divisor, -1, dtype):
        return
    raise KernelArgumentRefused(
        f"refused: trunc division of {least} by -1 overflows {dtype} (the CPU traps it); "
        "rounding_mode='floor' gives the wrapped result"
    )


def _least_common_multiple(arg: Arg) -> None:
    """No int32 or int64 minimum in an lcm: its gcd can come out -1 (|min| is min), and the
    division by it traps (SIGFPE, with the greatest value as the other)."""
    a, b = arg("self"), arg("other")
    dtype = torch.result_type(a, b)
    if dtype in (torch.int32, torch.int64):
        least = torch.iinfo(dtype).min
        if _holds(a, least, dtype) or _holds(b, least, dtype):
            raise KernelArgumentRefused(f"refused: lcm of {least} overflows {dtype} (the CPU "
                                        "traps on it)")  # fmt: skip


def _holds(t: Any, value: int, dtype: torch.dtype) -> bool:
    """Whether `t` (a tensor or a number) may hold `value` once cast to `dtype`, as the op
    computes (a 0-dim int64 or a Python int of 2**32 - 1 is -1 in int32): of a tensor, every
    value its storage holds, negated for a negated view."""
    if not isinstance(t, torch.Tensor):
        return bool(torch.tensor(t).to(dtype) == value)
    stored = stored_values(t)
    return bool(((-stored if t.is_neg() else stored).to(dtype) == value).any())


def _meet(a: Any, value_a: int, b: Any, value_b: int, dtype: torch.dtype) -> bool:
    """Whether `a` holds `value_a` where `b`, broadcast with it, holds `value_b` (in `dtype`),
    compared PAIRS_COMPARED at a time along the first dimension; a single row longer than
    that counts as a meeting (refused rather than compared whole)."""
    a, b = (torch.tensor(x) if not isinstance(x, torch.Tensor) else x for x in (a, b))
    a, b = torch.broadcast_tensors(a.to(dtype), b.to(dtype))
    if a.dim() == 0:
        return bool(a == value_a) and bool(b == value_b)
    row = a[0].numel()
    if row > PAIRS_COMPARED:
        return True
    step = max(1, PAIRS_COMPARED // max(1, row))
    for i in range(0, a.shape[0], step):
        if bool(((a[i : i + step] == value_a) & (b[i : i + step] == value_b)).any()):
            return True
    return False


def _antialias_scales(arg: Arg) -> None:
    """Scales that the sizes could come from: an antialiased resize reads 1/scale input
    pixels for each output pixel, from weight tables of that size (a 4x4 gradient with
    scales of 1e-8 allocated 1.5 GB). Resizing by a factor s gives floor(input * s) pixels,
    so an honest 1/s is at most input/output; up to twice that and one more is allowed."""
    grad = arg("grad_output")
    inputs = arg("input_size") if grad is not None else arg("self").shape
    for axis, name in ((-2, "scales_h"), (-1, "scales_w")):
        scale = arg(name)
        if scale is None or scale <= 0:  # (the kernel takes input / output then)
            continue
        into, out = int(inputs[axis]), max(1, int(arg("output_size")[axis]))
        if 1 / scale > 2 * into / out + 1:
            raise KernelArgumentRefused(
                f"{name} must be about output / input size ({out} / {into}), not {scale:g}: "
                f"it would read {1 / scale:.3g} input pixels for each output pixel"
            )


# Source coordinates an upsampling's scale may give at most (int64 holds them).
SOURCE_MOST = float(1 << 62)
# The upsamplings (and their backwards) that take input coordinates from scales.
_UPSAMPLINGS = ("upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d",
                "_upsample_nearest_exact1d", "_upsample_nearest_exact2d",
                "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
                "upsample_bicubic2d", "upsample_trilinear3d")  # fmt: skip


def _upsample_scales(arg: Arg) -> None:
    """Scales that keep source coordinates within int64: an upsampling (and its backward)
    takes output index i from input coordinate i / scale, cast to int64 and clamped from
    above only. A scale of 1e-20 made it INT64_MIN, read at that index (a uint8 nearest
    upsampling segfaulted). Honest scales (F.interpolate's) are about output / input size;
    align_corners ignores them; a scale of 0, below or NaN stands for output / input size."""
    sizes = [abs(int(n)) for n in arg("output_size")]
    if arg("align_corners") or not sizes:
        return
    names = ("scales",) if len(sizes) == 1 else ("scales_d", "scales_h", "scales_w")[-len(sizes) :]
    for name, out in zip(names, sizes):
        scale = arg(name)
        if scale is not None and scale > 0 and max(1, out) / scale >= SOURCE_MOST:
            raise KernelArgumentRefused(
                f"{name} of {scale:g} maps output pixels to input coordinates up to "
                f"{max(1, out) / scale:.3g}, past {SOURCE_MOST:g}: an honest scale is about "
                "output / input size"
            )


def _nll_loss_targets(arg: Arg) -> None:
    """Targets that each name a class or are ignore_index, and a weight per class, as the
    forward requires: the backward (reduction='none') indexed the gradient and the weights
    with them unchecked (another client's values read; the heap written, a segfault)."""
    input, target = arg("self"), arg("target")
    classes = input.shape[1] if input.dim() >= 2 else input.shape[0] if input.dim() else 0
    if isinstance(target, torch.Tensor) and not (target.is_floating_point() or target.is_complex()):
        target = target[target != arg("ignore_index")]
    _in_range(target, "target", classes)
    _sized(arg("weight"), "weight", classes)


# --- the rest --------------------------------------------------------------------------------


def _segments(arg: Arg) -> None:
    """Lengths or offsets that cover no more than the data's axis (what they leave at its
    end is ignored), and a gradient shaped as the output it is the gradient of."""
    data, axis = arg("data"), arg("axis", 0)
    if not isinstance(axis, int) or not -data.dim() <= axis < max(1, data.dim()):
        raise KernelArgumentRefused("axis is not a dimension of data")
    axis %= max(1, data.dim())
    extent = data.shape[axis] if data.dim() else 1
    lengths, offsets = arg("lengths"), arg("offsets")
    given = lengths if isinstance(lengths, torch.Tensor) else offsets
    if not isinstance(given, torch.Tensor) or given.dim() != axis + 1:
        raise KernelArgumentRefused("lengths or offsets need one dimension past axis")
    _shaped(given.shape[:-1], "lengths' or offsets' leading dimensions", data.shape[:axis])
    if arg("output") is not None:  # the backward: one output per segment
        segments = given.shape[-1] - (0 if given is lengths else 1)
        _shaped(arg("output"), "output", (*data.shape[:axis], segments, *data.shape[axis + 1 :]))
    if isinstance(lengths, torch.Tensor):
        _in_range(lengths, "lengths", extent + 1)
        if lengths.numel() and bool((lengths.sum(-1) > extent).any()):
            raise KernelArgumentRefused(f"lengths add up to more than data's {extent} on axis")
    if isinstance(offsets, torch.Tensor):
        _in_range(offsets, "offsets", extent + 1)
        if offsets.numel() and (
            bool((offsets[..., 0] != 0).any()) or bool((offsets[..., -1] > extent).any())
            or bool((offsets.diff(dim=-1) < 0).any())
        ):  # fmt: skip
            raise KernelArgumentRefused(f"offsets must run from 0 to {extent} at most, never down")
    if arg("grad") is not None:
        _shaped(arg("grad"), "grad", arg("output").shape)


# Grid coordinates (honest ones lie about -1..1) a grid sampler's backward takes at most.
GRID_MOST = float(1 << 24)


def _grid_sampler(arg: Arg) -> None:
    """Mode numbers that name a mode (others left the result uninitialised: heap bytes), and
    in the backward a grid within +-GRID_MOST (a NaN or infinite one, or a finite one that
    overflows once scaled to pixels, 1.8e38 at a width of 4, scattered the gradient at an
    index computed from it: a segfault, pytorch/pytorch#24823)."""
    if arg("interpolation_mode") not in (0, 1, 2) or arg("padding_mode") not in (0, 1, 2):
        raise KernelArgumentRefused("interpolation_mode and padding_mode must be 0, 1 or 2")
    grid = arg("grid")
    if arg("grad_output") is not None and not stored_magnitude(grid) <= GRID_MOST:
        raise KernelArgumentRefused(
            f"the grid of a grid sampler's backward must lie within +-{GRID_MOST:g}"
        )


def _rrelu_noise(arg: Arg) -> None:
    _shaped(arg("noise"), "noise", arg("self").shape)
    _dense(arg("noise"), "noise")


def _attention(arg: Arg) -> None:
    """Keys and values of one length, batch and heads; in the backward, `out`, `grad_out`
    and `logsumexp` shaped as the forward made them."""
    q, k, v = arg("query"), arg("key"), arg("value")
    if not q.dim() == k.dim() == v.dim() == 4:
        raise KernelArgumentRefused("query, key and value must be 4-D")
    _shaped(k.shape[:2], "key's batch and heads", q.shape[:2])
    _shaped(v.shape[:3], "value's batch, heads and length", k.shape[:3])
    if arg("out") is not None:
        out = (*q.shape[:3], v.shape[3])
        _shaped(arg("out"), "out", out)
        _shaped(arg("grad_out"), "grad_out", out)
        _shaped(arg("logsumexp"), "logsumexp", q.shape[:3])


def _ctc(arg: Arg) -> None:
    """Targets that name classes, lengths within the inputs, and in the backward a
    `log_alpha`, `neg_log_likelihood` and `grad` shaped as the forward made them."""
    log_probs, targets = arg("log_probs"), arg("targets")
    if log_probs.dim() not in (2, 3):
        raise KernelArgumentRefused("log_probs must be (T, C) or (T, N, C)")
    steps, classes = log_probs.shape[0], log_probs.shape[-1]
    batch = log_probs.shape[1] if log_probs.dim() == 3 else 1
    _in_range(targets, "targets", classes)
    if not isinstance(arg("blank"), int) or not 0 <= arg("blank") < classes:
        raise KernelArgumentRefused(f"blank must name one of the {classes} classes")
    if targets.dim() == 2 and targets.shape[0] != batch:
        raise KernelArgumentRefused("2-D targets need a row per batch element")
    inputs, lengths = (torch.as_tensor(arg(n)).reshape(-1) for n in ("input_lengths",
                                                                    "target_lengths"))  # fmt: skip
    _sized(inputs, "input_lengths", batch)
    _sized(lengths, "target_lengths", batch)
    _in_range(inputs, "input_lengths", steps + 1, low=1)
    longest = targets.shape[-1] if targets.dim() == 2 else targets.numel()
    _in_range(lengths, "target_lengths", longest + 1)
    if targets.dim() != 2 and int(lengths.sum()) > targets.numel():
        raise KernelArgumentRefused("target_lengths add up to more than targets holds")
    if arg("log_alpha") is not None:
        most = int(lengths.max()) if lengths.numel() else 0
        alpha = arg("log_alpha")
        if alpha.dim() != 3 or alpha.shape[:2] != (batch, steps) or alpha.shape[2] < 2 * most + 1:
            raise KernelArgumentRefused("log_alpha is not shaped as the forward made it")
        _sized(arg("neg_log_likelihood"), "neg_log_likelihood", batch)
        _sized(arg("grad"), "grad", batch)


def _ldl_pivots(arg: Arg) -> None:
    """LAPACK's pivots of an LDL factorisation (lower): a positive one names a row; a
    negative one opens a 2 x 2 block whose second pivot repeats it. A block left open at
    the end made the solver index row n + 1."""
    pivots = arg("pivots")
    n = pivots.shape[-1] if pivots.dim() else 0
    _in_range(pivots.abs(), "pivots' rows", n + 1, low=1)
    for row in pivots.reshape(-1, n).tolist() if n else []:
        k = 0
        while k < n:
            if row[k] > 0:
                k += 1
            elif k + 1 < n and row[k + 1] == row[k]:
                k += 2
            else:
                raise KernelArgumentRefused("pivots open a 2 x 2 block they do not close")


def _pdist(arg: Arg) -> None:
    """A matrix of points, as `torch.pdist` gives (the kernels index any other input as
    one); in the backward, the gradient and the distances shaped as the forward made them."""
    points = arg("self")
    if points.dim() != 2:
        raise KernelArgumentRefused(f"pdist's input must be 2-D, not {points.dim()}-D")
    if arg("pdist") is not None:
        n = points.shape[0]
        _shaped(arg("grad_output"), "grad_output", arg("pdist").shape)
        _sized(arg("pdist"), "pdist", n * (n - 1) // 2)


def _cdist_backward(arg: Arg) -> None:
    """The gradient and the distances shaped as the forward made them."""
    x1, x2, distances = arg("x1"), arg("x2"), arg("cdist")
    _shaped(arg("grad_output"), "grad_output", distances.shape)
    try:
        batch = torch.broadcast_shapes(x1.shape[:-2], x2.shape[:-2])
    except RuntimeError as e:
        raise KernelArgumentRefused(str(e)) from None
    _shaped(distances, "cdist", (*batch, x1.shape[-2], x2.shape[-2]))


def _unfold_backward(arg: Arg) -> None:
    """A gradient shaped as `unfold(dim, size, step)` of a tensor of `input_sizes`. The
    kernel reads the gradient's windows (fewer than its dimension at `dim` has) and `size`
    values of each, so with a window longer than the dimension (which torch runs) any number
    of windows but none is read within it."""
    sizes, dim, size, step = list(arg("input_sizes")), arg("dim"), arg("size"), arg("step")
    if not sizes:
        sizes, dim = [1], 0
    if not -len(sizes) <= dim < len(sizes) or step < 1 or size < 0:
        raise KernelArgumentRefused("dim, size or step do not unfold input_sizes")
    dim %= len(sizes)
    unfolded, grad = list(sizes), arg("grad_in")
    unfolded[dim] = (sizes[dim] - size) // step + 1
    if unfolded[dim] < 1 and isinstance(grad, torch.Tensor) and grad.dim() == len(sizes) + 1:
        unfolded[dim] = max(1, grad.shape[dim])
    _shaped(grad, "grad_in", [*unfolded, size])


def _multi_margin_backward(arg: Arg) -> None:
    input = arg("self")
    rows = input.shape[0] if input.dim() == 2 else 1
    _in_range(arg("target"), "target", input.shape[-1] if input.dim() else 1)
    _sized(arg("target"), "target", rows)
    _sized(arg("grad_output"), "grad_output", rows if arg("reduction") == 0 else 1)
    _sized(arg("weight"), "weight", input.shape[-1] if input.dim() else 1)


_GATES = {0: 1, 1: 1, 2: 4, 3: 3}  # RNN_RELU, RNN_TANH, LSTM, GRU: gates per unit


def _rnn_layer(arg: Arg) -> None:
    """Weights, biases and states sized for `hidden_size` and the input's features. The
    kernel reads its input as (steps, batch, features) whatever `batch_first` and
    `batch_sizes` say (it keeps them and never reads them; torch's LSTM transposes a
    batch-first input itself and passes batch_first=True): so are its states checked."""
    input, hidden = arg("input"), arg("hidden_size")
    if input.dim() != 3 or not isinstance(hidden, int) or hidden < 1:
        raise KernelArgumentRefused("input must be 3-D and hidden_size positive")
    gates = _GATES.get(arg("mode"))
    if gates is None:
        raise KernelArgumentRefused("mode must name an RNN kind")
    batch = input.shape[1]
    first = 0 if arg("weight0") is not None else 1  # (the backward counts them from 1)
    weights = [arg(f"weight{first + i}") for i in range(4)]
    _shaped(weights[0], "the input weights", (gates * hidden, input.shape[2]))
    _shaped(weights[1], "the hidden weights", (gates * hidden, hidden))
    if arg("has_biases"):
        _sized(weights[2], "the input bias", gates * hidden)
        _sized(weights[3], "the hidden bias", gates * hidden)
    _sized(arg("hx_"), "hx_", batch * hidden)
    _sized(arg("cx_"), "cx_", batch * hidden)
    _sized(arg("cx_tmp"), "cx_tmp", batch * hidden)
    if arg("workspace") is not None:  # the backward: what the forward returned
        steps = input.shape[0]
        for name in ("output", "grad_output"):
            _shaped(arg(name), name, (steps, batch, hidden))
        for name in ("hy_", "cy_", "grad_hy", "grad_cy"):
            _sized(arg(name), name, batch * hidden)
        for name in ("output", "hy_", "cy_", "grad_output", "grad_hy", "grad_cy"):
            t = arg(name)  # (read as the input's dtype: a bfloat16 gradient was read past)
            if t is not None and t.dtype != input.dtype:
                raise KernelArgumentRefused(f"{name} must be {input.dtype}")
        workspace = arg("workspace")
        size = _rnn_workspace_bytes(tuple(input.shape), hidden, input.dtype, bool(arg("reverse")),
                                    bool(arg("has_biases")))  # fmt: skip
        if workspace.dtype != torch.uint8 or workspace.numel() != size:
            raise KernelArgumentRefused(f"workspace must be the forward's {size} bytes")


# Kernels that read their tensors as if contiguous (an expanded `out` or `hx_` was read past
# its storage): all their tensors are made contiguous first (they write none of them).
READ_AS_CONTIGUOUS = frozenset({"aten::_scaled_dot_product_flash_attention_for_cpu_backward",
                                "aten::_ctc_loss_backward", "aten::_cdist_backward",
                                "aten::_pdist_backward", "aten::native_layer_norm_backward",
                                "aten::_segment_reduce_backward", "aten::unfold_backward",
                                "aten::multi_margin_loss_backward", "aten::mkldnn_rnn_layer",
                                "aten::mkldnn_rnn_layer_backward"})  # fmt: skip


@functools.lru_cache(maxsize=64)
def _rnn_workspace_bytes(
    shape: tuple[int, ...], hidden: int, dtype: torch.dtype, reverse: bool, biases: bool
) -> int:
    """The size of the workspace oneDNN's LSTM forward makes for these sizes: a shorter one
    (or one of a shorter sequence's forward) was read and written past. Found by running
    the forward on zeros once per shape: oneDNN does not say."""
    steps, batch, features = shape
    zeros = torch.zeros
    out = torch.ops.aten.mkldnn_rnn_layer(
        zeros(steps, batch, features, dtype=dtype), zeros(4 * hidden, features, dtype=dtype),
        zeros(4 * hidden, hidden, dtype=dtype), zeros(4 * hidden, dtype=dtype),
        zeros(4 * hidden, dtype=dtype), zeros(1, batch, hidden, dtype=dtype),
        zeros(1, batch, hidden, dtype=dtype), reverse, [], 2, hidden, 1, biases, False, False,
        True,
    )  # fmt: skip
    return out[3].numel()


# Ops checked on their values alone: their tensors are read where they lie, never copied.
VALUES_ONLY = frozenset({"aten::div", "aten::div_", "aten::lcm", "aten::lcm_"})

CHECKS: dict[str, Callable[[Arg], None]] = {
    "aten::div": _integer_division,
    "aten::div_": _integer_division,
    "aten::lcm": _least_common_multiple,
    "aten::lcm_": _least_common_multiple,
    "aten::_upsample_bilinear2d_aa": _antialias_scales,
    "aten::_upsample_bilinear2d_aa_backward": _antialias_scales,
    "aten::embedding": _embedding,
    "aten::embedding_renorm_": _embedding_renorm,
    "aten::embedding_dense_backward": _embedding_dense_backward,
    "aten::_embedding_bag": _embedding_bag,
    "aten::_embedding_bag_forward_only": _embedding_bag,
    "aten::_embedding_bag_backward": _embedding_bag_backward,
    "aten::_embedding_bag_per_sample_weights_backward": _per_sample_weights_backward,
    "aten::max_pool2d_with_indices_backward": _pool_backward(2, True),
    "aten::max_pool3d_with_indices_backward": _pool_backward(3, True),
    "aten::adaptive_max_pool2d_backward": _pool_backward(2, True),
    "aten::adaptive_max_pool3d_backward": _pool_backward(3, True),
    "aten::avg_pool2d_backward": _pool_backward(2, False),
    "aten::avg_pool3d_backward": _pool_backward(3, False),
    "aten::reflection_pad1d_backward": _reflection_pad_backward,
    "aten::reflection_pad2d_backward": _reflection_pad_backward,
    "aten::reflection_pad3d_backward": _reflection_pad_backward,
    "aten::fractional_max_pool2d_backward": _pool_backward(2, True),
    "aten::fractional_max_pool3d_backward": _pool_backward(3, True),
    "aten::_adaptive_avg_pool2d_backward": _pool_backward(2, False),
    "aten::_adaptive_avg_pool3d_backward": _pool_backward(3, False),
    "aten::convolution": _convolution,
    "aten::convolution_backward": _convolution_backward,
    "aten::_fft_c2c": _fft_dims,
    "aten::_fft_r2c": _fft_dims,
    "aten::_fft_c2r": _fft_dims,
    "aten::native_batch_norm": _batch_norm,
    "aten::_native_batch_norm_legit": _batch_norm,
    "aten::_batch_norm_with_update": _batch_norm,
    "aten::native_batch_norm_backward": _batch_norm,
    "aten::batch_norm_backward": _batch_norm,
    "aten::native_layer_norm_backward": _layer_norm_backward,
    "aten::segment_reduce": _segments,
    "aten::_segment_reduce_backward": _segments,
    "aten::grid_sampler_2d": _grid_sampler,
    "aten::grid_sampler_2d_backward": _grid_sampler,
    "aten::grid_sampler_3d": _grid_sampler,
    "aten::grid_sampler_3d_backward": _grid_sampler,
    "aten::rrelu_with_noise": _rrelu_noise,
    "aten::rrelu_with_noise_": _rrelu_noise,
    "aten::rrelu_with_noise_backward": _rrelu_noise,
    "aten::_scaled_dot_product_flash_attention_for_cpu": _attention,
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward": _attention,
    "aten::_ctc_loss": _ctc,
    "aten::_ctc_loss_backward": _ctc,
    "aten::linalg_ldl_solve": _ldl_pivots,
    "aten::_cdist_backward": _cdist_backward,
    "aten::_pdist_forward": _pdist,
    "aten::_pdist_backward": _pdist,
    "aten::unfold_backward": _unfold_backward,
    "aten::multi_margin_loss_backward": _multi_margin_backward,
    "aten::mkldnn_rnn_layer": _rnn_layer,
    "aten::mkldnn_rnn_layer_backward": _rnn_layer,
    "aten::native_group_norm": _group_norm,
    "aten::native_group_norm_backward": _group_norm,
    "aten::_log_softmax_backward_data": _softmax_backward,
    "aten::_softmax_backward_data": _softmax_backward,
    "aten::nll_loss_backward": _nll_loss_targets,
    "aten::nll_loss2d_backward": _nll_loss_targets,
    **{
        f"aten::{name}{way}": _upsample_scales for name in _UPSAMPLINGS for way in ("", "_backward")
    },
}
