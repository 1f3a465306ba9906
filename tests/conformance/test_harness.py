"""The conformance harness itself: a wrong value, a refusal, a crash and a hang are caught."""

from __future__ import annotations

import pytest

from tests.conformance import harness_ops, opinfo_cases
from tests.conformance.opinfo_cases import run_unit
from tests.conformance.sweep import sweep

OPS = {opinfo_cases.entry_id(op): op for op in harness_ops.EXTRA_OPS}


def test_a_wrong_value_fails_the_unit():
    outcome = run_unit(OPS["harness.wrong"], "float32", "eager")
    assert (outcome.status, outcome.kind) == ("fail", "wrong")
    assert "values differ" in outcome.message
    assert run_unit(OPS["harness.wrong"], "float32", "traced").status == "pass"


def test_a_refusal_counts_only_for_listed_entries(monkeypatch):
    outcome = run_unit(OPS["harness.refuse"], "float32", "eager")
    assert (outcome.status, outcome.kind) == ("fail", "refusal")
    assert outcome.message == "RecordError: refused on purpose"
    monkeypatch.setitem(opinfo_cases.REFUSED, "harness.refuse", "a test of the harness")
    assert run_unit(OPS["harness.refuse"], "float32", "eager").status == "refused"


@pytest.fixture
def harness_children(monkeypatch):
    monkeypatch.setenv("GG_CONFORMANCE_EXTRA", "harness_ops")


def test_a_segfault_or_hang_fails_one_unit_and_the_sweep_carries_on(harness_children):
    both = [("float32", "eager"), ("float32", "traced")]
    work = [("harness.segfault", both), ("harness.hang", both), ("harness.neg", both)]
    outcomes = sweep(work, processes=1, sample_timeout=3.0)
    got = {(o.entry, o.mode): (o.status, o.kind) for o in outcomes}
    assert got == {
        ("harness.segfault", "eager"): ("fail", "crash"),
        ("harness.segfault", "traced"): ("pass", ""),  # after the restart
        ("harness.hang", "eager"): ("fail", "timeout"),
        ("harness.hang", "traced"): ("pass", ""),
        ("harness.neg", "eager"): ("pass", ""),
        ("harness.neg", "traced"): ("pass", ""),
    }
    crash = next(o for o in outcomes if o.kind == "crash")
    assert "SIGSEGV" in crash.message
