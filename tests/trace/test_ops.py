"""Torch ops on pointers give what plain torch gives on the same inputs.

Every case runs twice: eagerly (one round trip per op) and recorded in `gg.trace()` then
fetched. Inputs are spread over the workers round-robin, so many cases also cross workers.
"""

from __future__ import annotations

import contextlib
import re

import pytest
import torch
import torch.nn.functional as F

import gridgraph as gg
from gridgraph.trace import record


def _get(out):
    if isinstance(out, gg.RemoteTensor):
        return out.get()
    if isinstance(out, (tuple, list)):
        return type(out)(_get(o) for o in out)
    return out


def check(grid, fn, *inputs, traced: bool = True, exact: bool = False):
    """Assert fn(pointers) == fn(local tensors) (within the dtype's tolerance)."""
    want = fn(*[i.clone() for i in inputs])
    pointers = [
        gg.send(t.clone(), grid.workers[k % len(grid.workers)]) for k, t in enumerate(inputs)
    ]
    if traced:
        with gg.trace():
            out = fn(*pointers)
    else:
        out = fn(*pointers)
    got = _get(out)
    if exact:
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    else:
        torch.testing.assert_close(got, want, equal_nan=True)
    return pointers


g = torch.Generator().manual_seed(0)


def r(*shape):
    return torch.randn(*shape, generator=g)


CASES = {
    # elementwise, with Python scalars and broadcasting
    "add": (lambda a, b: a + b, r(4, 5), r(5)),
    "sub_scalar": (lambda a: 3 - a * 0.5, r(4, 5)),
    "mul_div": (lambda a, b: a * b / (b.abs() + 1), r(3, 4), r(3, 4)),
    "pow_exp_log": (lambda a: (a.abs() + 1).log().pow(2) + a.exp(), r(6)),
    "activations": (lambda a: torch.sigmoid(a) + torch.tanh(a) + F.relu(a) + F.gelu(a), r(8)),
    "clamp_where": (lambda a, b: torch.where(a > 0, a, b).clamp(-0.5, 0.5), r(4, 4), r(4, 4)),
    "compare": (lambda a, b: (a > b) & (a != 0) | (b <= -1), r(5), r(5)),
    "maximum_sqrt": (lambda a, b: torch.maximum(a, b).abs().sqrt(), r(7), r(7)),
    # reductions
    "sum_mean": (lambda a: a.sum() + a.mean(0).sum() + a.sum(1, keepdim=True).mean(), r(5, 6)),
    "max_min_arg": (lambda a: (a.max(), a.min(), a.argmax(), a.argmin(1)), r(5, 6)),
    "std_var_norm": (
        lambda a: (a.std(), a.var(1), a.norm(), torch.linalg.vector_norm(a, 1)),
        r(4, 6),
    ),
    "softmax": (lambda a: (F.softmax(a, 1), F.log_softmax(a, 0), torch.logsumexp(a, 1)), r(3, 5)),
    "cumsum_prod": (lambda a: (a.cumsum(1), a.prod(1)), r(3, 4)),
    # matmul
    "mm": (lambda a, b: a @ b, r(8, 5), r(5, 3)),
    "bmm": (lambda a, b: torch.bmm(a, b), r(2, 3, 4), r(2, 4, 5)),
    "matmul_batched": (lambda a, b: a @ b, r(2, 3, 4), r(4, 2)),
    "addmm_linear": (lambda a, w, b: F.linear(a, w, b), r(6, 4), r(3, 4), r(3)),
    "einsum": (lambda a, b: torch.einsum("ij,jk->ik", a, b), r(3, 4), r(4, 2)),
    # convolution, pooling, normalisation
    "conv2d": (
        lambda x, w, b: F.conv2d(x, w, b, padding=1, stride=2),
        r(2, 3, 8, 8),
        r(4, 3, 3, 3),
        r(4),
    ),
    "conv1d": (lambda x, w: F.conv1d(x, w), r(2, 3, 10), r(5, 3, 3)),
    "conv_transpose2d": (
        lambda x, w: F.conv_transpose2d(x, w, stride=2),
        r(1, 2, 4, 4),
        r(2, 3, 3, 3),
    ),
    "pooling": (
        lambda x: (F.max_pool2d(x, 2), F.avg_pool2d(x, 2), F.adaptive_avg_pool2d(x, 1)),
        r(2, 3, 6, 6),
    ),
    "batch_norm": (
        lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True),
        r(4, 3, 5, 5),
        r(3),
        r(3),
    ),
    "layer_group_norm": (lambda x: (F.layer_norm(x, (5,)), F.group_norm(x, 1)), r(2, 4, 5)),
    # indexing and slicing
    "index_slice": (lambda a: (a[0], a[:, 1:3], a[..., ::2], a[-1, -2]), r(4, 5)),
    "index_tensor": (
        lambda a: (
            a[torch.tensor([2, 0, 2])],
            a.index_select(1, torch.tensor([1])),
            a.gather(1, torch.tensor([[0], [1], [2], [0]])),
        ),
        r(4, 3),
    ),
    "scatter_masked_fill": (
        lambda a: (a.scatter(1, torch.tensor([[0], [2]]), 9.0), a.masked_fill(a > 0, 0.0)),
        r(2, 3),
    ),
    # a value given as a 0-dim tensor, remote or local (older torch's `a[i] = 7.0` does this)
    "fill_tensor": (
        lambda a, b: (torch.fill(a, b), a.clone().fill_(b), a[1].fill_(torch.tensor(7.0)), a),
        r(3, 4),
        r(()),
    ),
    # views
    "views": (
        lambda a: (
            a.view(-1),
            a.reshape(2, 10),
            a.t(),
            a.transpose(0, 1).contiguous(),
            a.permute(1, 0),
            a.unsqueeze(0).expand(3, 4, 5),
            a.flatten(),
            a.narrow(1, 1, 2),
            a[None, :, None].squeeze(),
        ),
        r(4, 5),
    ),
    "as_strided": (lambda a: a.as_strided((3, 3), (1, 3), 2), r(4, 5)),
    # one element expanded: stride 0 on dimensions of size 1, as sent back and shipped along
    "expand_one_element": (
        lambda a, b: (a.expand_as(b), b + torch.tensor(2.0).expand(1, 1), a.expand(1, 1, 1)),
        r(1).reshape(()),
        r(1, 1),
    ),
    # dtype casts
    "casts": (
        lambda a: (a.double(), a.to(torch.float16), (a * 10).long(), a.bool(), a.int()),
        r(3, 3),
    ),
    # lists, cat, stack, mixing local tensors
    "cat_stack": (
        lambda a, b: (torch.cat([a, b]), torch.stack([a, b], 1), a.repeat(2, 1)),
        r(2, 3),
        r(2, 3),
    ),
    "mixed_local": (lambda a: a * torch.arange(3.0) + torch.ones(2, 3), r(2, 3)),
    "pad": (lambda a: F.pad(a, [1, 2]), r(2, 3)),
    # multi-output ops
    "topk_sort": (lambda a: (a.topk(2), a.sort(1), a.max(1), a.min(0)), r(3, 5)),
    "split_chunk_unbind": (lambda a: (a.split(2), a.chunk(3, 1), a.unbind(0)), r(4, 6)),
}


@pytest.mark.parametrize("traced", [True, False], ids=["traced", "eager"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_op_matches_torch(grid, name, traced):
    fn, *inputs = CASES[name]
    check(grid, fn, *inputs, traced=traced)


def _inplace(a, b):
    a.add_(b)
    a.mul_(2).clamp_(-1, 1)
    return a


def _write_through_view(a):
    v = a[1]  # a view
    v.zero_()  # writes a's storage
    a[:, 0] = 7.0  # setitem: index_put_/copy_ into a view
    return a.sum(1), v


def _read_before_write(a):
    before = a * 1  # must see the old contents even though it runs later
    a.add_(10)
    return before, a


def _batch_norm_running_stats(x, mean, var):
    F.batch_norm(x, mean, var, training=True)
    return mean, var


@pytest.mark.parametrize("traced", [True, False], ids=["traced", "eager"])
@pytest.mark.parametrize(
    "fn, inputs",
    [
        (_inplace, (r(3, 4), r(3, 4))),
        (_write_through_view, (r(3, 4),)),
        (_read_before_write, (r(3),)),
    ],
    ids=["inplace", "view_write", "read_before_write"],
)
def test_mutation_matches_torch(grid, fn, inputs, traced):
    check(grid, fn, *inputs, traced=traced, exact=True)


def _set_data(a, b):
    a.data = b.t()  # another shape and layout: `a` now shares b's storage
    b.add_(1)
    return a * 1, a.mul_(3), b


@pytest.mark.parametrize("traced", [True, False], ids=["traced", "eager"])
def test_setting_data_matches_torch(grid, traced):
    """`p.data = q` makes p name q's value (it named its old one, silently), as
    `model.double()` relies on."""
    check(grid, _set_data, r(2, 3), r(3, 2), traced=traced, exact=True)
    model = torch.nn.Linear(3, 2)
    sent = gg.send(torch.nn.Linear(3, 2), grid.workers[0])
    sent.load_state_dict(model.state_dict())
    x = r(4, 3).double()
    with gg.trace() if traced else contextlib.nullcontext():
        got = sent.double()(gg.send(x, grid.workers[1]))
    torch.testing.assert_close(got.get(), model.double()(x), rtol=0, atol=0)
    with pytest.raises(TypeError, match="send t first"):
        sent.weight.data = torch.zeros(2, 3)


def _complex(*shape):
    return torch.randn(*shape, dtype=torch.complex64, generator=g)


@pytest.mark.parametrize("traced", [True, False], ids=["traced", "eager"])
def test_lazy_conjugation_matches_torch(local_grid, traced):
    """x.conj() is a view with a conjugate bit: the pointer carries it as torch's tensor
    does (code above ATen branches on it), and sending or fetching one sends its values."""
    a = _complex(8)

    def fn(a):
        c = a.conj()
        return c, c.is_conj(), torch.fft.hfft(c), c.imag, torch.view_as_real(c.resolve_conj())

    check(local_grid, fn, a, traced=traced)
    p = gg.send(a.conj(), local_grid.workers[1])  # a conjugate view sent as its values
    assert torch.equal(p.get(), a.conj())
    with pytest.raises(RuntimeError, match="conjugate"):
        torch.view_as_real(p.conj())  # refused at the call, as torch refuses it


# Tensors with no elements: recorded, placed, split, sent and run like any other.
EMPTY_CASES = {
    "matmul": (lambda a, b: a @ b, r(0, 3), r(3, 2)),
    "cat_reduce": (lambda a, b: (torch.cat([a, b]), a.sum(0), b.mean(1)), r(0, 3), r(2, 3)),
    "views": (lambda a: (a.t(), a.view(3, 0), a[:, 1:], a.unsqueeze(1)), r(0, 3)),
    "inplace": (lambda a: a.add_(1).mul_(2), r(2, 0)),
    "empty_to_full": (lambda a, b: b + a.sum(), r(0), r(4)),
    # torch's meta kernels of these are wrong about empty inputs (trace/meta.py): an inf
    # norm over a negative dim raised, pixel_unshuffle gave another shape than the kernel,
    # the nearest upsamplings raised a TypeError
    "inf_norm": (
        lambda a: (
            torch.linalg.vector_norm(a, float("inf"), -1),
            torch.linalg.vector_norm(a, float("-inf"), (-2,), keepdim=True),
        ),
        r(0, 5, 3),
    ),
    "pixel_unshuffle": (
        lambda a, b: [(u, u.shape) for u in (F.pixel_unshuffle(a, 3), F.pixel_unshuffle(b, 2))],
        r(0, 1, 6, 6),
        r(1, 1, 4, 0),
    ),
    "nearest_upsampling": (
        lambda a, b, c: (
            F.interpolate(a, size=3),
            F.interpolate(b, size=(3, 2), mode="nearest-exact"),
            F.interpolate(c, scale_factor=2.0),
        ),
        r(0, 3, 4),
        r(0, 2, 4, 4).contiguous(memory_format=torch.channels_last),
        r(0, 1, 2, 2, 2),
    ),
}


@pytest.mark.parametrize("traced", [True, False], ids=["traced", "eager"])
@pytest.mark.parametrize("name", sorted(EMPTY_CASES))
def test_zero_element_tensors(grid, name, traced):
    fn, *inputs = EMPTY_CASES[name]
    check(grid, fn, *inputs, traced=traced, exact=True)


@pytest.mark.parametrize("traced", [True, False], ids=["traced", "eager"])
def test_nearest_upsampling_of_an_input_empty_past_its_batch_raises_as_torch_does(grid, traced):
    x = r(2, 0, 4)
    with pytest.raises(RuntimeError, match="Non-empty 3D data tensor expected") as want:
        F.interpolate(x, size=3)
    p = gg.send(x, grid.workers[0])
    with pytest.raises(RuntimeError, match=re.escape(str(want.value))):
        with gg.trace() if traced else contextlib.nullcontext():
            out = F.interpolate(p, size=3)
        out.get()


def _shape_in_place(a, b):
    a.t_()  # (3, 2) -> (2, 3)
    a.unsqueeze_(0).transpose_(0, 2)  # (3, 2, 1)
    a.squeeze_(2).swapdims_(0, 1)  # (2, 3)
    return a.shape, a + b, a.stride(), a.contiguous()


def _resize_and_restride(a):
    a.as_strided_((2, 2), (1, 3), 1)
    b = a * 1
    a.resize_(3)  # shrinks: the first three elements of the storage stay
    return b, a.shape, a.clone()


def _grow(a):
    n, view = len(a), a[1:3]
    a.resize_(n + 5)  # grows: a received tensor's storage must be memory torch can grow
    a[1:3].fill_(5.0)
    return a.shape, a[:n].clone(), view.clone()


def _grow_after_read(a):
    before = a.tolist()  # the worker sends its bytes
    a.resize_(len(before) + 5)
    return a[: len(before)].clone()


@pytest.mark.parametrize("traced", [True, False], ids=["traced", "eager"])
@pytest.mark.parametrize(
    "fn, inputs",
    [(_shape_in_place, (r(3, 2), r(2, 3))), (_resize_and_restride, (r(6),)), (_grow, (r(3),)),
     (_grow_after_read, (r(3),))],
    ids=["squeeze_unsqueeze_transpose", "as_strided_resize", "grow_small", "grow_after_read"],
)  # fmt: skip
def test_in_place_shape_changes_match_torch(grid, fn, inputs, traced):
    """In-place ops that change shape or strides rebind the pointer with the new layout."""
    check(grid, fn, *inputs, traced=traced, exact=True)


@pytest.mark.parametrize("traced", [True, False], ids=["traced", "eager"])
def test_ops_that_change_shapes_in_place_inside(local_grid, traced):
    """matmul with a 1-D operand, quantile and stft use squeeze_ / transpose_ internally."""
    window = torch.hann_window(8)
    fn = lambda a, b, c: (a @ b, b.t() @ a, torch.quantile(b, 0.3, dim=1),  # noqa: E731
                          torch.stft(c, 8, window=window, return_complex=True))  # fmt: skip
    check(local_grid, fn, r(3), r(3, 4), r(64), traced=traced)


def test_a_local_tensor_mixed_in_is_its_value_at_the_call(local_grid):
    """A traced op runs later than torch would run it: a local tensor mixed into it must be
    the value it had at the call, even when the user writes to it before the op runs."""
    base, scale = r(3, 4), torch.ones(4)
    p = gg.send(base.clone(), local_grid.workers[0])
    with gg.trace():
        got = p * scale
        p.add_(scale)
    scale.mul_(5)  # before anything ran
    torch.testing.assert_close((got.get(), p.get()), (base, base + 1), rtol=0, atol=0)


@pytest.mark.parametrize("traced", [True, False], ids=["traced", "eager"])
def test_keyword_arguments_are_told_apart(local_grid, traced):
    """torch drops keyword arguments equal to their default, so right=True and
    out_int32=True reach ATen as one bool each: neither the shape cache nor the plan cache
    may mix them up."""
    a, bounds = r(6), torch.sort(r(4))[0]

    def fn(a, bounds):
        return [torch.bucketize(a, bounds, right=True), torch.bucketize(a, bounds, out_int32=True)]

    for _ in range(2):  # the second time runs cached plans
        check(local_grid, fn, a, bounds, traced=traced, exact=True)


@pytest.mark.parametrize("traced", [True, False], ids=["traced", "eager"])
def test_one_op_on_inputs_that_differ_only_in_layout_or_scalars(local_grid, traced):
    """Recording caches what it derives per op and input metadata (output shape, strides,
    aliasing): a call whose inputs differ only in strides, offset, dtype, an int or a float
    gets its own, so each result matches torch's, values and layout alike."""
    base = r(4, 6)

    def fn(a):
        outs = []
        for x in (a, a.t(), a[1:], a[:, 1:], a.double(), a[::2]):
            outs += [x.sum(0), x.sum(1), x.clamp(-0.5, 0.5), x.clamp(-1.5, 1.5), x * 2, x.t()]
            outs += [x.contiguous(), x.unsqueeze(0), torch.flatten(x.unsqueeze(1), 1, 2)]
        return outs

    for _ in range(2):  # the second time, every call finds its recipe cached
        want = fn(base.clone())
        a = gg.send(base.clone(), local_grid.workers[0])
        with gg.trace() if traced else contextlib.nullcontext():
            got = fn(a)
        assert [(p.shape, p.stride(), p.dtype) for p in got] == [
            (w.shape, w.stride(), w.dtype) for w in want
        ]
        torch.testing.assert_close(_get(got), want, rtol=0, atol=0)


@pytest.mark.parametrize("traced", [True, False], ids=["traced", "eager"])
def test_complex_scalars_are_told_apart_bit_for_bit(local_grid, traced):
    """A complex scalar is part of the plan: 0j and -0j, equal in Python, must not share
    one, or the signs of zero in the result are the first call's."""
    a = _complex(4)
    p = gg.send(a, local_grid.workers[0])
    for c in (0j, complex(0.0, -0.0), complex(-0.0, 0.0), complex(-0.0, -0.0)):
        want = torch.view_as_real(a * c)
        with gg.trace() if traced else contextlib.nullcontext():
            got = torch.view_as_real(p * c)
        assert torch.equal(got.get().signbit(), want.signbit()), c


def test_a_nan_scalar_adds_nothing_to_the_caches_per_call(local_grid):
    """NaN is unequal to itself: kept as it is in a cache key, each call adds an entry."""
    x, z = r(4), _complex(4)
    px, pz = gg.send(x, local_grid.workers[0]), gg.send(z, local_grid.workers[0])

    def fn(x, z):
        return x.clamp(max=float("nan")), z * complex("nan+1j")

    torch.testing.assert_close(_get(fn(px, pz)), fn(x, z), equal_nan=True)
    cached = len(record._recipes), len(record._signatures)
    for _ in range(5):
        with gg.trace():
            fn(px, pz)
    assert (len(record._recipes), len(record._signatures)) == cached


@pytest.mark.parametrize("traced", [True, False], ids=["traced", "eager"])
def test_batch_norm_updates_running_stats(grid, traced):
    x, mean, var = r(4, 3, 2, 2), torch.zeros(3), torch.ones(3)
    want = _batch_norm_running_stats(x, mean.clone(), var.clone())
    w0, w1, _ = grid.workers
    args = gg.send(x, w0), gg.send(mean, w1), gg.send(var, w1)  # buffers live together
    with gg.trace() if traced else contextlib.nullcontext():
        got = _batch_norm_running_stats(*args)
    torch.testing.assert_close(_get(got), want)


@pytest.mark.parametrize("traced", [True, False], ids=["traced", "eager"])
def test_one_op_writing_tensors_on_two_workers_moves_one(grid, traced):
    """Running stats on two workers: one moves to the other, then batch norm runs there."""
    x, mean, var = r(4, 3, 2, 2), torch.zeros(3), torch.ones(3)
    want = _batch_norm_running_stats(x, mean.clone(), var.clone())
    w0, w1, w2 = grid.workers
    args = gg.send(x, w0), gg.send(mean, w1), gg.send(var, w2)
    with gg.trace() if traced else contextlib.nullcontext():
        got = _batch_norm_running_stats(*args)
    torch.testing.assert_close(_get(got), want)
    assert args[1].location == args[2].location == "w1"  # a tie: the first one stays


def test_the_smaller_tensor_moves(local_grid):
    w0, w1, _ = local_grid.workers
    big, small = r(4096), r(4)
    p_big, p_small = gg.send(big.clone(), w1), gg.send(small.clone(), w0)
    local_grid.reset_stats()
    torch._foreach_add_([p_small, p_big], 1.0)  # one op writing both
    assert p_small.location == p_big.location == "w1"
    assert local_grid.stats()["bytes"] < 4096 * 4  # the big one did not travel
    assert torch.equal(p_big.get(), big + 1) and torch.equal(p_small.get(), small + 1)


def test_a_view_on_another_worker_is_not_moved(local_grid):
    w0, w1, _ = local_grid.workers
    a, b = r(4, 3), r(100)
    pa, pb = gg.send(a, w0), gg.send(b, w1)  # b is larger: a's storage would move
    row = pa[1]  # a view of a: moving it alone would break the aliasing
    with pytest.raises(gg.PlacementError, match="shares its storage"):
        torch._foreach_add_([row, pb], 1.0)
    assert torch.equal(pa.get(), a) and torch.equal(pb.get(), b)  # nothing half-applied
    assert (pa.location, pb.location) == ("w0", "w1")


@pytest.mark.parametrize("traced", [True, False], ids=["traced", "eager"])
def test_a_transferred_tensor_keeps_its_layout(grid, traced):
    """A transposed tensor sent to another worker stays transposed there: what is computed
    from it has torch's strides, so as_strided on the result reads torch's elements."""
    a, b = r(3, 4), r(4, 3)

    def fn(a, b):
        y = a.t() + b  # the sum follows a.t()'s layout: strides (1, 4)
        return y.as_strided((2, 2), (1, 4)), y.stride(), y.permute(1, 0).contiguous()

    want = fn(a, b)
    pa, pb = gg.send(a, grid.workers[0]), gg.send(b, grid.workers[1])
    with gg.trace() if traced else contextlib.nullcontext(), gg.on(grid.workers[1]):
        got = fn(pa, pb)  # a.t() is a view: it stays on w0, the sum runs on w1
    torch.testing.assert_close(_get(got), want, rtol=0, atol=0)


def test_later_read_sees_write_through_view(grid):
    a = r(3, 4)
    p = gg.send(a.clone(), grid.workers[0])
    with gg.trace():
        row = p[2]
        row.mul_(0)
    a[2].mul_(0)
    assert torch.equal(p.get(), a)
    assert torch.equal(row.get(), a[2])


@pytest.mark.parametrize(
    "fn",
    [
        lambda a: torch.nonzero(a > 0),
        lambda a: a[a > 0],
        lambda a: torch.masked_select(a, a < 0),
        lambda a: torch.unique(torch.round(a)),
        lambda a: (a[a > 0] * 2).sum(),  # carries on recording after the data-dependent op
    ],
    ids=["nonzero", "bool_index", "masked_select", "unique", "carry_on"],
)
def test_data_dependent_ops(grid, fn):
    check(grid, fn, r(4, 5))


@pytest.mark.parametrize("traced", [True, False], ids=["traced", "eager"])
def test_ops_whose_meta_kernel_reads_values_run_for_real(local_grid, traced):
    """allclose calls .item() inside its meta kernel; it runs on the worker instead."""
    a = r(4, 5)
    fn = lambda a, b: (torch.allclose(a, b), torch.allclose(a, a + 1e-9), (a - b).mean())  # noqa: E731
    check(local_grid, fn, a, a * 2, traced=traced)


@pytest.mark.parametrize("traced", [True, False], ids=["traced", "eager"])
def test_tensor_split_at_remote_indices(local_grid, traced):
    """tensor_split's C++ reads its index tensor's memory; a pointer's values are fetched."""
    fn = lambda a, at, n: (a.tensor_split(at), torch.tensor_split(a, n, 1))  # noqa: E731
    check(local_grid, fn, r(6, 4), torch.tensor([1, 4]), torch.tensor(3), traced=traced)


def test_a_wrong_call_still_raises_torchs_error_at_once(local_grid):
    w0, w1, _ = local_grid.workers
    a, b = gg.send(r(3, 4), w0), gg.send(r(5), w1)
    local_grid.reset_stats()
    with pytest.raises(RuntimeError, match="broadcast|size") as raised:
        a.add_(b)  # in place: refused on the meta device, nothing is sent
    assert not isinstance(raised.value, gg.RemoteError)
    assert local_grid.stats()["messages"] == 0
    with pytest.raises(RuntimeError, match="broadcast|size"):
        with gg.trace():
            (a + b).sum().item()


def test_sync_points(grid):
    a = r(3, 4)
    p = gg.send(a, grid.workers[1])
    with gg.trace():
        s = p.sum()
        assert s.item() == pytest.approx(a.sum().item())
        assert bool(s > -1000) is True
        assert p[0].tolist() == a[0].tolist()
        assert int(p[0, 0] > 0) == int(a[0, 0] > 0)
        if p.max() > 0:  # Python control flow on a remote value
            q = p * 2
        assert torch.equal(q.get(), a * 2)


def test_ops_across_workers_transfer_automatically(grid):
    a, b = r(16, 8), r(8, 4)
    x, w = gg.send(a, grid.workers[0]), gg.send(b, grid.workers[2])
    grid.reset_stats()
    with gg.trace():
        y = torch.tanh(x @ w)
    torch.testing.assert_close(y.get(), torch.tanh(a @ b))
    stats = grid.stats()
    # one run message to each of the two workers, one transfer between them, two replies
    assert stats["messages"] == 5


@pytest.mark.parametrize("seed", [0, 7])
def test_random_ops_are_seedable_per_worker(grid, seed):
    w = grid.workers[1]
    p = gg.send(torch.zeros(4, 5), w)

    def draws(t):
        return (
            torch.randn_like(t),
            torch.rand_like(t),
            t.clone().normal_(),
            F.dropout(t + 1, 0.5),
            torch.bernoulli(t + 0.5),
        )

    w.manual_seed(seed)
    with gg.trace():
        got = draws(p)
    got = _get(got)
    torch.manual_seed(seed)
    want = draws(torch.zeros(4, 5))
    torch.testing.assert_close(got, want)
