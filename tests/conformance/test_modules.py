"""Every ModuleInfo entry trained through pointers, against torch: the targets, per module.

The sweep (conftest.py) runs each module's units (dtype, train or eval, eager or traced) in
crash-proof child processes. Per dtype and mode, the share of samples that pass must meet
the target (refusals count as failures), and every module must pass; whatever else
happens, never a wrong value, a crash or a hang, and a refusal only for the documented list.
"""

from __future__ import annotations

import pytest

from tests.conformance.module_cases import load_entries
from tests.conformance.refused import REFUSED
from tests.conformance.report import FAILURES_FILES, MODULE_SAMPLE_TARGET, sample_counts
from tests.conformance.sweep import Selection, plan

WORK = plan(Selection.from_env("modules"))
ROWS = sorted({unit for _, units in WORK for unit in units})


@pytest.mark.parametrize(("dtype", "mode"), ROWS, ids=[f"{d}-{m}" for d, m in ROWS])
def test_sample_pass_rate_meets_target(module_outcomes, dtype, mode):
    row = [o for o in module_outcomes if (o.dtype, o.mode) == (dtype, mode)]
    samples, failing = sample_counts(row)
    failing_modules = sorted(o.entry for o in row if o.status == "fail")
    assert (samples - failing) / samples >= MODULE_SAMPLE_TARGET, (
        f"{dtype} {mode}: {samples - failing} of {samples} samples pass, target "
        f"{MODULE_SAMPLE_TARGET:.1%}; failing: {', '.join(failing_modules)}; causes in "
        f"{FAILURES_FILES['modules']}"
    )


@pytest.mark.parametrize("module", [entry for entry, _ in WORK])
def test_every_module_passes(module_outcomes, module):
    outcomes = [o for o in module_outcomes if o.entry == module]
    bad = [o for o in outcomes if o.status == "fail"]
    if module in REFUSED:  # refused by design: refused or right, nothing else
        bad = [o for o in outcomes if o.status == "fail" and o.kind != "refusal"]
    assert not bad, "\n".join(
        f"{o.dtype} {o.mode} [{o.kind}] {o.failed} of {o.samples} samples fail: {o.message}"
        for o in bad
    )


def test_refused_modules_are_modules_that_refuse(module_outcomes):
    modules = load_entries()
    swept = {o.entry for o in module_outcomes}
    refusing = {o.entry for o in module_outcomes if o.status == "refused"}
    listed = [name for name in REFUSED if name in modules]
    stale = [name for name in listed if name in swept and name not in refusing]
    assert not stale, f"listed as refused by design but they work: {stale}; remove them"
