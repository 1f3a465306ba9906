"""The sweep runs once per pytest session, when a conformance test asks for its outcomes.

$GG_CONFORMANCE_ENTRIES (a regular expression on entry names), $GG_CONFORMANCE_DTYPES and
$GG_CONFORMANCE_MODES (comma-separated) narrow it while developing; CI runs everything.
"""

from __future__ import annotations

import pytest

from tests.conformance import report
from tests.conformance.opinfo_sweep import Selection

_swept: list = []  # (outcomes, wall seconds) once the sweep has run


@pytest.fixture(scope="session")
def sweep_outcomes():
    """Every unit's Outcome; also writes conformance_failures.txt at the repository root."""
    outcomes, wall = report.run(Selection.from_env())
    report.write_failures(outcomes)
    _swept.append((outcomes, wall))
    return outcomes


def pytest_terminal_summary(terminalreporter) -> None:
    for outcomes, wall in _swept:
        terminalreporter.write_sep("-", "OpInfo conformance (python -m tests.conformance.report)")
        terminalreporter.write_line(report.table(outcomes, wall))
