"""The conformance tables and failure lists; run as a script to sweep and print them.

    .venv/bin/python -m tests.conformance.report                   # both suites (minutes)
    .venv/bin/python -m tests.conformance.report --suite opinfo --entries '^nn\\.' \\
        --dtypes float32 --modes eager,traced                        # a subset
    .venv/bin/python -m tests.conformance.report --suite modules --entries LSTM

For each suite it prints one row per dtype and mode: for OpInfo, the entries that support
the dtype, how many pass, are refused by design, fail; for ModuleInfo, the same of modules
and then of their samples (a module's unit runs all its samples, counting those that fail).
Then the sweep's wall time; and it writes the failing units grouped by cause, the most
common first, to `conformance_failures.txt` (OpInfo) and `module_conformance_failures.txt`
(ModuleInfo) at the repository root.
"""

from __future__ import annotations

import argparse
import collections
import math
import os
import re
import sys
import time

from tests.conformance.opinfo_cases import Outcome
from tests.conformance.sweep import ROOT, SUITES, Selection, plan, suite_module, sweep

FAILURES_FILES = {
    "opinfo": os.path.join(ROOT, "conformance_failures.txt"),
    "modules": os.path.join(ROOT, "module_conformance_failures.txt"),
}
FAILURES_FILE = FAILURES_FILES["opinfo"]
TITLES = {"opinfo": "OpInfo conformance", "modules": "ModuleInfo conformance"}

# Targets, OpInfo: the share of entries that pass, per dtype and mode.
FORWARD_TARGET = 0.99
BACKWARD_TARGET = 0.98
# ModuleInfo: the share of samples that pass, per dtype and mode; and every module.
MODULE_SAMPLE_TARGET = 0.995


def target(mode: str) -> float:
    return BACKWARD_TARGET if mode.startswith("bwd") else FORWARD_TARGET


def rows(outcomes: list[Outcome], suite: str = "opinfo") -> dict[tuple[str, str], list[Outcome]]:
    """(dtype, mode) -> its outcomes, in the suite's DTYPES and MODES order."""
    cases = suite_module(suite)
    by_row: dict[tuple[str, str], list[Outcome]] = {}
    for o in outcomes:
        by_row.setdefault((o.dtype, o.mode), []).append(o)
    order = {(d, m): (i, j) for i, d in enumerate(cases.DTYPES) for j, m in enumerate(cases.MODES)}
    return dict(sorted(by_row.items(), key=lambda kv: order[kv[0]]))


def statuses(row: list[Outcome]) -> collections.Counter:
    return collections.Counter(o.status for o in row)


def shown(rate: float) -> str:
    """A rate as a percentage rounded down, so that 98.97% never reads as 99.0%."""
    return f"{math.floor(rate * 1000) / 10:5.1f}%"


def pass_rate(c: collections.Counter) -> float:
    total = sum(c.values())
    return c["pass"] / total if total else 1.0


def table(outcomes: list[Outcome], wall_s: float | None = None, suite: str = "opinfo") -> str:
    """The conformance table of `suite` as text."""
    if suite == "modules":
        return module_table(outcomes, wall_s)
    head = f"{'dtype':10} {'mode':9} {'entries':>7} {'pass':>6} {'refused':>7} {'fail':>6} "
    head += f"{'pass %':>7} {'target':>6}"
    lines = [head, "-" * len(head)]
    for (dtype, mode), row in rows(outcomes).items():
        c = statuses(row)
        lines.append(
            f"{dtype:10} {mode:9} {sum(c.values()):7} {c['pass']:6} {c['refused']:7} "
            f"{c['fail']:6} {shown(pass_rate(c)):>7} {shown(target(mode)):>6}"
        )
    return "\n".join(lines + totals(outcomes, wall_s))


def sample_counts(row: list[Outcome]) -> tuple[int, int]:
    """(samples, failing) of a row of ModuleInfo units: a refused sample fails; a unit that
    crashed, hung or could not start counts its sample in flight as one failing."""
    lost = sum(1 for o in row if o.status == "fail" and not o.failed)
    return sum(o.samples for o in row) + lost, sum(o.failed for o in row) + lost


def module_table(outcomes: list[Outcome], wall_s: float | None = None) -> str:
    """The ModuleInfo table: modules, then samples, per dtype and mode."""
    head = f"{'dtype':10} {'mode':12} {'modules':>7} {'pass':>5} {'refused':>7} {'fail':>5} "
    head += f"{'samples':>8} {'failing':>7} {'pass %':>7} {'target':>6}"
    lines = [head, "-" * len(head)]
    for (dtype, mode), row in rows(outcomes, "modules").items():
        c = statuses(row)
        samples, failing = sample_counts(row)
        rate = (samples - failing) / samples if samples else 1.0
        lines.append(
            f"{dtype:10} {mode:12} {len(row):7} {c['pass']:5} {c['refused']:7} {c['fail']:5} "
            f"{samples:8} {failing:7} {shown(rate):>7} {shown(MODULE_SAMPLE_TARGET):>6}"
        )
    return "\n".join(lines + totals(outcomes, wall_s))


def totals(outcomes: list[Outcome], wall_s: float | None) -> list[str]:
    """The lines under a table: samples, the slowest, the wall time."""
    lines = []
    samples = sum(o.samples for o in outcomes)
    inexact = sum(o.inexact for o in outcomes)
    rejected = sum(o.rejected for o in outcomes)
    lines.append(
        f"{len(outcomes)} units, {samples} samples: {inexact} equal within tolerance, "
        f"{rejected} rejected by torch and the pointers alike, the rest bit-equal"
    )
    slowest = max(outcomes, key=lambda o: o.slowest, default=None)
    if slowest is not None:
        lines.append(f"slowest sample: {slowest.slowest:.1f} s ({slowest.entry} {slowest.dtype} "
                     f"{slowest.mode})")  # fmt: skip
    if wall_s is not None:
        lines.append(f"sweep wall time: {wall_s:.0f} s")
    return lines


def cause(o: Outcome) -> str:
    """The failure message with numbers and quoted names folded, to group like failures."""
    text = re.sub(r"\d+", "N", o.message)
    return f"[{o.kind}] {text}"


def failures_text(outcomes: list[Outcome]) -> str:
    """Failing units grouped by cause, the most common cause first."""
    groups: dict[str, list[Outcome]] = collections.defaultdict(list)
    for o in outcomes:
        if o.status == "fail":
            groups[cause(o)].append(o)
    out = []
    for key, group in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        entries = sorted({o.entry for o in group})
        out.append(f"## {len(group)} units, {len(entries)} entries: {key}")
        for o in sorted(group, key=lambda o: (o.entry, o.dtype, o.mode)):
            where = f"   [{' < '.join(reversed(o.detail))}]" if o.detail else ""
            out.append(f"  {o.entry} {o.dtype} {o.mode}: {o.message}{where}")
        out.append("")
    inexact = collections.Counter()
    for o in outcomes:
        inexact[o.entry] += o.inexact
    listed = ", ".join(f"{e} ({n})" for e, n in sorted(inexact.items()) if n)
    out.append(f"## passing, but samples equal only within tolerance: {listed or 'none'}")
    return "\n".join(out)


def write_failures(outcomes: list[Outcome], path: str = FAILURES_FILE, suite: str = "opinfo"):
    """Write the table and the failures by cause to `path` (a read-only checkout: skipped)."""
    try:
        with open(path, "w") as f:
            f.write(table(outcomes, suite=suite) + "\n\n" + failures_text(outcomes))
    except OSError as e:
        print(f"conformance: cannot write {path}: {e}", file=sys.stderr)


def run(selection: Selection, processes: int = 2, progress: bool = False):
    """Sweep `selection`; returns (outcomes, wall seconds). Every 30 s the failure list so
    far is written to the suite's FAILURES_FILES (and `progress` prints a count to stderr)."""
    work = plan(selection)
    total = sum(len(units) for _, units in work)
    so_far: list[Outcome] = []
    last = [time.monotonic()]

    def show(o: Outcome) -> None:
        so_far.append(o)
        if time.monotonic() - last[0] > 30:
            last[0] = time.monotonic()
            write_failures(so_far, FAILURES_FILES[selection.suite], selection.suite)
            if progress:
                failing = sum(o.status == "fail" for o in so_far)
                print(f"{len(so_far)}/{total} units, {failing} failing", file=sys.stderr)

    start = time.monotonic()
    outcomes = sweep(work, selection.suite, processes=processes, on_outcome=show)
    if progress:
        print(file=sys.stderr)
    return outcomes, time.monotonic() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--suite", choices=[*SUITES, "all"], default="all")
    parser.add_argument("--entries", default="", help="regular expression on entry names")
    parser.add_argument("--dtypes", default="", help="comma-separated; all of a suite's")
    parser.add_argument("--modes", default="", help="comma-separated; all of a suite's")
    parser.add_argument("--processes", type=int, default=2)
    args = parser.parse_args(argv)
    listed = lambda value: tuple(value.split(",")) if value else ()  # noqa: E731
    for suite in SUITES if args.suite == "all" else [args.suite]:
        selection = Selection(suite, args.entries, listed(args.dtypes), listed(args.modes))
        outcomes, wall = run(selection, args.processes, progress=True)
        write_failures(outcomes, FAILURES_FILES[suite], suite)
        print(f"{TITLES[suite]}\n{table(outcomes, wall, suite)}")
        print(f"failures by cause: {FAILURES_FILES[suite]}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
