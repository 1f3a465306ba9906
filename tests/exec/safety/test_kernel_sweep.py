"""A slice of the kernel sweep (scripts/sweep_kernels.py) on the kernels it found unsafe:
each adversarial case is refused before it runs, raises torch's own error, or gives what
plain torch gives; no case crashes the child, writes or reads outside its inputs. Each
refusal of the checks added for these kernels is shown to be unsafe (or refused) in plain
torch on the same values, each in a child of its own.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="forks children")

_SCRIPT = pathlib.Path(__file__).parents[3] / "scripts" / "sweep_kernels.py"


@pytest.fixture(scope="module")
def sweep():
    spec = importlib.util.spec_from_file_location("sweep_kernels", _SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["sweep_kernels"] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (a child forked from a process whose OpenMP threads run hangs)
    yield module
    torch.set_num_threads(threads)
    del sys.modules["sweep_kernels"]


def _samples(sweep) -> dict:
    """Sample calls as autograd and F.interpolate make them (reduction 0 is 'none')."""
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(3, 4, generator=g).log_softmax(1)
    target = torch.tensor([0, 3, 1])
    maps = torch.randn(2, 4, 3, 3, generator=g).log_softmax(1)
    target2d = torch.randint(0, 4, (2, 3, 3), generator=g)
    image = torch.randint(0, 255, (1, 3, 5, 5), dtype=torch.uint8, generator=g)  # (RGB)
    calls = [
        ("aten::nll_loss_backward",
         [torch.ones(3), scores, target, torch.rand(4, generator=g), 0, -100, torch.tensor(3.0)]),
        ("aten::nll_loss2d_backward",
         [torch.ones(2, 3, 3), maps, target2d, torch.rand(4, generator=g), 0, -100,
          torch.tensor(18.0)]),
        ("aten::upsample_nearest2d", [image, [7, 7], None, None]),
    ]  # fmt: skip
    return {name: [sweep.Sample(name, args, {})] for name, args in calls}


@pytest.fixture(scope="module")
def outcomes(sweep):
    return sweep.sweep(_samples(sweep))


def test_the_slice_has_no_finding(outcomes):
    findings = [f"{o.case.name} {o.case.argument} = {o.case.value}: {o.detail}"
                for o in outcomes if o.verdict == "finding"]  # fmt: skip
    assert not findings
    assert len(outcomes) > 80
    verdicts = {(o.case.name, o.case.argument, o.case.value): o for o in outcomes}
    for name in ("aten::nll_loss_backward", "aten::nll_loss2d_backward"):
        for value in ("first element 5", "last element 5", "first element -1", "last element -1"):
            assert verdicts[name, "target", value].worker["refused"] == "kernel_checks"
    for argument in ("scales_h", "scales_w"):
        assert verdicts["aten::upsample_nearest2d", argument, "1e-20"].worker["refused"] == (
            "kernel_checks"
        )
    # honest values still run and give what torch gives
    assert verdicts["aten::upsample_nearest2d", "scales_h", "-1.0"].verdict == "ran, equal"
    assert verdicts["aten::nll_loss_backward", "ignore_index", "-1"].verdict == "ran, equal"


def test_targets_refused_in_the_backward_are_refused_by_the_forward(sweep, outcomes):
    # The check is the forward's rule (a target names a class or is ignore_index); where the
    # backward reads or writes outside, the sweep saw it: a result that depends on the bytes
    # around the inputs (weight[5], weight[-1]), or a crash.
    forwards = {"aten::nll_loss_backward": torch.ops.aten.nll_loss_forward.default,
                "aten::nll_loss2d_backward": torch.ops.aten.nll_loss2d_forward.default}  # fmt: skip
    refused = [o for o in outcomes if o.case.name in forwards and o.case.argument == "target"
               and o.worker.get("refused") == "kernel_checks"]  # fmt: skip
    assert len(refused) == 2 * 2 * len(sweep.ADVERSARIAL["index tensor"])
    for o in refused:
        _, input, target, weight, reduction, ignore_index, _ = o.case.args
        with pytest.raises((IndexError, RuntimeError), match="out of bounds|Target"):
            forwards[o.case.name](input, target, weight, reduction, ignore_index)
    unsafe = {(o.case.name, o.case.value) for o in refused if sweep._unsafe(o.torch)}
    for name in forwards:
        assert {(name, "first element 5"), (name, "last element -1")} <= unsafe


def test_a_tiny_scale_crashes_a_plain_uint8_nearest_upsampling(sweep):
    # 1 / 1e-20 cast to int64 is INT64_MIN, which min(index, size - 1) lets through.
    (sample,) = _samples(sweep)["aten::upsample_nearest2d"]
    image = sample.args[0]
    case = sweep.Case(sample.name, "scales_h, scales_w", "1e-20", [image, [7, 7], 1e-20, 1e-20], {})
    assert sweep.run_case(case).worker["refused"] == "kernel_checks"
    plain = sweep.in_child(sweep._as_torch, case, sweep.PATTERNS[0])
    if "signal" not in plain:  # (the vectorised uint8 path differs between CPUs)
        pytest.skip(f"this CPU's uint8 path survives it: {plain}")
    assert plain == {"signal": 11}


def test_a_dtype_given_as_a_number_is_refused_before_its_meta_run(sweep):
    # Found by the sweep: full_like with dtype=-2 segfaulted in its meta run, the first
    # thing a worker does with a call; -1 hung there.
    x, rest = torch.ones(1, dtype=torch.float64), {"layout": torch.strided, "device": "cpu"}
    case = sweep.Case("aten::full_like", "dtype", "-2", [x, 0.5], {"dtype": -2, **rest})
    outcome = sweep.run_case(case)
    assert outcome.verdict == "refused"
    assert "dtype must be a dtype, not -2" in outcome.worker["error"]
    # (Plain torch reads a type table at index -2: a segfault, a hang, an error made of what
    # it read, or a result, depending on the bytes there; so it is not asserted here.)
    honest = sweep.Case("aten::full_like", "dtype", "float32", [x, 0.5],
                        {"dtype": torch.float32, **rest})  # fmt: skip
    assert sweep.run_case(honest).verdict == "ran, equal"


def test_a_factorys_device_does_not_make_its_result_in_the_footprint():
    # Found by the sweep: new_zeros(x, [2**31], device="cpu") made and zeroed its 8 GiB for
    # real in the meta run that checks it against the memory limit (20 s, uncharged).
    from gridgraph.exec.safety.limits import meta_like, op_footprint

    x = meta_like(torch.ones(1, 1))
    result, made, _, _ = op_footprint(
        torch.ops.aten.new_zeros.default, [x, [1 << 20]], {"device": torch.device("cpu")}
    )
    assert result.is_meta and sum(made.values()) == 4 << 20


def test_in_place_variants_are_sampled_too(sweep):
    # The capture ran OpInfos' functions and their backwards only: 18 allowlisted in-place
    # ops (cumsum_, scatter_*, index_copy_, triu_, ...) had no sample and were never swept.
    found = sweep.capture({"aten::cumsum_", "aten::index_copy_"}, 1, "^(cumsum|index_copy)$")
    assert set(found) == {"aten::cumsum_", "aten::index_copy_"}
    (sample,) = found["aten::index_copy_"]
    assert any(c.argument == "index" for c in sweep.cases(sample))


def test_kernels_taken_only_without_autograd_are_sampled_too(sweep):
    # embedding_bag takes _embedding_bag_forward_only when its weight needs no gradient: the
    # capture ran every float sample with autograd, and never reached it.
    found = sweep.capture({"aten::_embedding_bag_forward_only"}, 1, "^nn.functional.embedding_bag$")
    assert set(found) == {"aten::_embedding_bag_forward_only"}


def test_an_in_place_layout_refused_before_it_changes_is_a_refusal(sweep):
    # as_strided_ checks its layout before it changes its tensor (ops._as_strided_): the
    # sweep counted that check's ViewOutOfBounds as a result outside its storage, a finding.
    # Plain torch makes the view, whose elements lie past its storage.
    x = torch.arange(4.0)
    case = sweep.Case("aten::as_strided_", "storage_offset", str(2**63 - 1),
                      [x, [1], [1], 2**63 - 1], {})  # fmt: skip
    outcome = sweep.run_case(case)
    assert outcome.verdict == "refused" and outcome.worker["refused"] == "layout"
    assert "plain torch returns a view outside its storage" in outcome.detail
    honest = sweep.Case("aten::as_strided_", "storage_offset", "1", [x, [2], [1], 1], {})
    assert sweep.run_case(honest).verdict == "ran, equal"
