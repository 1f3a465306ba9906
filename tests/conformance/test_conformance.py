"""Every OpInfo entry through pointers, against torch: the targets, and per entry the rules.

The sweep (conftest.py) runs each entry's units in crash-proof child processes. Per dtype and
mode, the share of entries that pass must meet the target; per entry, whatever else happens,
never a wrong value, a crash or a hang, and a refusal only for the documented list.
"""

from __future__ import annotations

import pytest

from tests.conformance.opinfo_cases import load_entries
from tests.conformance.refused import REFUSED
from tests.conformance.report import FAILURES_FILE, target
from tests.conformance.sweep import Selection, plan

WORK = plan(Selection.from_env())
ROWS = sorted({unit for _, units in WORK for unit in units}, key=lambda u: (u[1], u[0]))


@pytest.mark.parametrize(("dtype", "mode"), ROWS, ids=[f"{d}-{m}" for d, m in ROWS])
def test_pass_rate_meets_target(sweep_outcomes, dtype, mode):
    row = [o for o in sweep_outcomes if (o.dtype, o.mode) == (dtype, mode)]
    passing = sum(o.status == "pass" for o in row)
    failing = sorted(o.entry for o in row if o.status == "fail")
    assert passing / len(row) >= target(mode), (
        f"{dtype} {mode}: {passing} of {len(row)} entries pass ({passing / len(row):.1%}), "
        f"target {target(mode):.0%}; failing: {', '.join(failing[:40])}"
        f"{' ...' if len(failing) > 40 else ''}; causes in {FAILURES_FILE}"
    )


@pytest.mark.parametrize("entry", [entry for entry, _ in WORK])
def test_never_a_wrong_value_crash_or_hang(sweep_outcomes, entry):
    outcomes = [o for o in sweep_outcomes if o.entry == entry]
    bad = [o for o in outcomes if o.kind in ("wrong", "crash", "timeout")]
    if entry in REFUSED:  # refused by design: refused or right, nothing else
        bad = [o for o in outcomes if o.status == "fail"]
    assert not bad, "\n".join(f"{o.dtype} {o.mode} [{o.kind}] {o.message}" for o in bad)


def test_refused_list_names_entries_that_refuse(sweep_outcomes):
    entries = load_entries()
    unknown = [name for name in REFUSED if name not in entries]
    assert not unknown, f"not OpInfo entries: {unknown}"
    swept = {o.entry for o in sweep_outcomes}
    refusing = {o.entry for o in sweep_outcomes if o.status == "refused"}
    stale = [name for name in REFUSED if name in swept and name not in refusing]
    assert not stale, f"listed as refused by design but they work: {stale}; remove them"
