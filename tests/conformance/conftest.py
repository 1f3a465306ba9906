"""Each suite sweeps once per pytest session, when a conformance test asks for its outcomes.

$GG_CONFORMANCE_ENTRIES (a regular expression on entry names), $GG_CONFORMANCE_DTYPES and
$GG_CONFORMANCE_MODES (comma-separated) narrow the OpInfo sweep while developing;
$GG_MODULES_ENTRIES, $GG_MODULES_DTYPES and $GG_MODULES_MODES the ModuleInfo one. CI runs
everything. Both tables print at the end of the run.
"""

from __future__ import annotations

import pytest

from tests.conformance import report
from tests.conformance.sweep import Selection

_swept: dict[str, tuple] = {}  # suite -> (outcomes, wall seconds) once it has run


def _outcomes(suite: str) -> list:
    outcomes, wall = report.run(Selection.from_env(suite))
    report.write_failures(outcomes, report.FAILURES_FILES[suite], suite)
    _swept[suite] = (outcomes, wall)
    return outcomes


@pytest.fixture(scope="session")
def sweep_outcomes():
    """Every OpInfo unit's Outcome; also writes conformance_failures.txt."""
    return _outcomes("opinfo")


@pytest.fixture(scope="session")
def module_outcomes():
    """Every ModuleInfo unit's Outcome; also writes module_conformance_failures.txt."""
    return _outcomes("modules")


def pytest_terminal_summary(terminalreporter) -> None:
    for suite, (outcomes, wall) in sorted(_swept.items(), key=lambda kv: kv[0] != "opinfo"):
        terminalreporter.write_sep(
            "-", f"{report.TITLES[suite]} (python -m tests.conformance.report)"
        )
        terminalreporter.write_line(report.table(outcomes, wall, suite))
