"""The worker's op rules: an explicit allowlist, a bounds check on every op's result, zeroed
uninitialised memory; and on the client, ops outside the list decomposed into listed ones."""

from __future__ import annotations

import pytest
import torch

import gridgraph as gg
from gridgraph.errors import RecordError
from gridgraph.exec.worker.ops import RandomState, ViewOutOfBounds, check_view
from gridgraph.trace.allowlist import (
    ALLOWED,
    CATEGORIES,
    REFUSED,
    UNINITIALIZED,
    OpRefused,
    category,
    resolve,
)

aten = torch.ops.aten

# Each was callable on a worker under the old deny list.
DANGEROUS = [
    "aten::_reshape_alias",  # a view past its storage, no bounds check: read another's data
    "aten::_sparse_coo_tensor_unsafe",  # then add_: a segfault
    "aten::manual_seed",  # reseeds the process-wide generator
    "aten::seed",
    "aten::set_.source_Tensor",  # points a stored tensor at another's storage
    "aten::set_.source_Storage_storage_offset",
    "aten::_test_serialization_subcmul",
    "aten::_test_check_tensor",
    "aten::from_file",
    "aten::_nested_view_from_buffer",
    "aten::_nested_tensor_from_mask",
    "aten::_unsafe_index.Tensor",
    "aten::_make_per_tensor_quantized_tensor",
    "aten::empty.memory_format",  # uninitialised, and no tensor input: never recorded
    "aten::mm.out",
    "aten::_local_scalar_dense",
]


@pytest.mark.parametrize("name", DANGEROUS)
def test_dangerous_ops_are_refused(name):
    with pytest.raises(OpRefused, match="not on the workers' op allowlist"):
        resolve(name)


@pytest.mark.parametrize("name", ["os.system", "aten::add.Tensor; x", "prims::add", 5, None])
def test_names_that_are_not_aten_overloads_are_refused(name):
    with pytest.raises(OpRefused):
        resolve(name)


def test_the_allowlist_is_small_categorised_and_every_name_resolves():
    schemas = {s.name + (f".{s.overload_name}" if s.overload_name else "")
               for s in torch._C._jit_get_all_schemas()}  # fmt: skip
    print(f"allowlist: {len(ALLOWED)} of {len(schemas)} ATen schemas, "
          f"{len(CATEGORIES)} categories: "
          + ", ".join(f"{c} {len(n)}" for c, n in CATEGORIES.items()))  # fmt: skip
    assert len(ALLOWED) < len(schemas) / 4
    names = [n for listed in CATEGORIES.values() for n in listed]
    assert len(names) == len(set(names)), "an op is listed under two categories"
    for name in ALLOWED:
        op = resolve(name)
        short = name.removeprefix("aten::")
        assert category(name) is not None
        assert not short.startswith(("_test", "_sparse", "_nested", "_reshape_alias", "set_"))
        assert not short.startswith("_unsafe") or short == "_unsafe_view"
        assert not short.endswith(".out"), name
        assert "resize" not in short or short in ("resize_", "resize_as_")  # zeroed (ops.py)
        assert op._schema.name == name.split(".")[0]
    for refused in REFUSED.values():
        assert not ALLOWED & {f"aten::{n}" for n in refused}


@pytest.mark.parametrize("name", sorted(UNINITIALIZED))
def test_uninitialised_results_are_zeroed(name):
    # Fill memory and free it, so that an uninitialised allocation likely reuses it.
    for _ in range(4):
        del _
        junk = torch.full((4096,), 7.0)
        del junk
    x = torch.ones(4096)
    args = {"empty_like": [x], "new_empty": [x, [4096]], "new_empty_strided": [x, [4096], [1]]}
    out = RandomState().call(resolve(f"aten::{name}"), args[name], {})
    assert torch.equal(out, torch.zeros(4096))


def test_views_inside_their_storage_pass():
    x = torch.arange(12.0)
    for view in (x, x[3:], x.view(3, 4).t(), x.expand(5, 12), x[:0], torch.empty(0, 3)[:, 1:]):
        check_view(view)
    check_view((x, None, x[1:]))


def test_a_view_past_its_storage_is_refused():
    x = torch.zeros(4)
    view = aten._reshape_alias.default(x, [100], [1])  # built with no bounds check
    with pytest.raises(ViewOutOfBounds, match="needs 400 bytes of a storage of 16"):
        check_view(view)
    with pytest.raises(ViewOutOfBounds):
        check_view([x, view])
    shifted = aten._reshape_alias.default(x[2:], [3], [1])  # contiguous, offset 2: one past
    with pytest.raises(ViewOutOfBounds, match="needs 20 bytes of a storage of 16"):
        check_view(shifted)


# --- on the client: ops outside the list -------------------------------------------------


def test_an_op_outside_the_list_is_decomposed_into_listed_ones(local_grid):
    x, mask = torch.randn(4, 5), torch.rand(4, 5) > 0.5
    idx = torch.tensor([0, 1, 3, 2])
    assert "aten::_unsafe_masked_index" not in ALLOWED
    with gg.trace():
        got = aten._unsafe_masked_index(x.send(local_grid.workers[0]), mask, [idx], 0.5)
    ops = {n.name for n in local_grid.client.graph.pending.values()}
    assert ops and all(name in ALLOWED for name in ops), ops
    assert torch.equal(got.get(), aten._unsafe_masked_index(x, mask, [idx], 0.5))


def test_an_op_outside_the_list_without_a_decomposition_fails_at_the_call(local_grid):
    p = torch.zeros(4).send(local_grid.workers[0])
    with pytest.raises(RecordError, match="aten::set_.source_Tensor is not on the workers' op"):
        p.set_(torch.ones(3))
    assert torch.equal(p.get(), torch.zeros(4))
