"""The conformance table and the failure list; run as a script to sweep and print them.

    .venv/bin/python -m tests.conformance.report                   # everything (minutes)
    .venv/bin/python -m tests.conformance.report --entries '^nn\\.' --dtypes float32 \\
        --modes eager,traced                                         # a subset

It prints one row per dtype and mode (OpInfo entries that support the dtype, how many pass,
are refused by design, fail), the sweep's wall time, and writes the failing units grouped
by cause, the most common first, to `conformance_failures.txt` at the repository root.
"""

from __future__ import annotations

import argparse
import collections
import math
import os
import re
import sys
import time

from tests.conformance.opinfo_cases import DTYPES, MODES, Outcome
from tests.conformance.opinfo_sweep import ROOT, Selection, plan, sweep

FAILURES_FILE = os.path.join(ROOT, "conformance_failures.txt")

# Targets: the share of entries that pass, per dtype and mode.
FORWARD_TARGET = 0.99
BACKWARD_TARGET = 0.98


def target(mode: str) -> float:
    return BACKWARD_TARGET if mode.startswith("bwd") else FORWARD_TARGET


def rows(outcomes: list[Outcome]) -> dict[tuple[str, str], collections.Counter]:
    """(dtype, mode) -> counts of pass / refused / fail, in DTYPES and MODES order."""
    counts: dict[tuple[str, str], collections.Counter] = {}
    for o in outcomes:
        counts.setdefault((o.dtype, o.mode), collections.Counter())[o.status] += 1
    order = {(d, m): (i, j) for i, d in enumerate(DTYPES) for j, m in enumerate(MODES)}
    return dict(sorted(counts.items(), key=lambda kv: order[kv[0]]))


def shown(rate: float) -> str:
    """A rate as a percentage rounded down, so that 98.97% never reads as 99.0%."""
    return f"{math.floor(rate * 1000) / 10:5.1f}%"


def pass_rate(c: collections.Counter) -> float:
    total = sum(c.values())
    return c["pass"] / total if total else 1.0


def table(outcomes: list[Outcome], wall_s: float | None = None) -> str:
    """The conformance table as text."""
    head = f"{'dtype':10} {'mode':9} {'entries':>7} {'pass':>6} {'refused':>7} {'fail':>6} "
    head += f"{'pass %':>7} {'target':>6}"
    lines = [head, "-" * len(head)]
    for (dtype, mode), c in rows(outcomes).items():
        lines.append(
            f"{dtype:10} {mode:9} {sum(c.values()):7} {c['pass']:6} {c['refused']:7} "
            f"{c['fail']:6} {shown(pass_rate(c)):>7} {shown(target(mode)):>6}"
        )
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
    return "\n".join(lines)


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


def write_failures(outcomes: list[Outcome], path: str = FAILURES_FILE) -> None:
    """Write the table and the failures by cause to `path` (a read-only checkout: skipped)."""
    try:
        with open(path, "w") as f:
            f.write(table(outcomes) + "\n\n" + failures_text(outcomes))
    except OSError as e:
        print(f"conformance: cannot write {path}: {e}", file=sys.stderr)


def run(selection: Selection, processes: int = 2, progress: bool = False):
    """Sweep `selection`; returns (outcomes, wall seconds). Every 30 s the failure list so
    far is written to FAILURES_FILE (and `progress` prints a count to stderr)."""
    work = plan(selection)
    total = sum(len(units) for _, units in work)
    so_far: list[Outcome] = []
    last = [time.monotonic()]

    def show(o: Outcome) -> None:
        so_far.append(o)
        if time.monotonic() - last[0] > 30:
            last[0] = time.monotonic()
            write_failures(so_far)
            if progress:
                failing = sum(o.status == "fail" for o in so_far)
                print(f"{len(so_far)}/{total} units, {failing} failing", file=sys.stderr)

    start = time.monotonic()
    outcomes = sweep(work, processes=processes, on_outcome=show)
    if progress:
        print(file=sys.stderr)
    return outcomes, time.monotonic() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--entries", default="", help="regular expression on entry names")
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--failures", default=FAILURES_FILE, help="where to write the list")
    args = parser.parse_args(argv)
    selection = Selection(args.entries, tuple(args.dtypes.split(",")), tuple(args.modes.split(",")))
    outcomes, wall = run(selection, args.processes, progress=True)
    write_failures(outcomes, args.failures)
    print(table(outcomes, wall))
    print(f"failures by cause: {args.failures}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
