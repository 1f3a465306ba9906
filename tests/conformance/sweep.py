"""The sweep: every unit of every selected entry of one suite, run in crash-proof processes.

Two suites share it: OpInfo's ops (`opinfo_cases`) and ModuleInfo's modules
(`module_cases`); each names its dtypes and modes and runs one unit (`run_unit`).

A small pool of long-lived child processes (this file run with `--serve`) imports torch,
the databases and gridgraph once, then takes one entry at a time from the parent and
streams back what happens: the unit it starts, each sample it starts, each unit's `Outcome`.
So the parent always knows which unit is in flight:

    a child that dies (segfault, abort, exit)   that unit fails as "crash", the child is
                                                restarted, the entry's other units carry on
    a sample that runs past `sample_timeout`    that unit fails as "timeout", the child is
                                                killed and restarted, the same way

Children run with one intra-op thread each, and import gridgraph from this checkout.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib
import json
import os
import re
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable

from tests.conformance.opinfo_cases import Outcome

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# A child that gives no sign of life for this long is hung: an op's sample takes
# milliseconds; a module's (a Transformer's forward and backward, eager: hundreds of round
# trips) up to seconds, ten on a loaded machine.
SAMPLE_TIMEOUTS = {"opinfo": 10.0, "modules": 60.0}
# Importing torch and the OpInfo database takes several seconds; allow for a busy machine.
START_TIMEOUT = 120.0

# Each suite's module: its DTYPES, MODES, load_entries, units_of and run_unit; and the prefix
# of the environment variables that narrow its pytest run.
SUITES = {"opinfo": "tests.conformance.opinfo_cases", "modules": "tests.conformance.module_cases"}
ENV_PREFIX = {"opinfo": "GG_CONFORMANCE_", "modules": "GG_MODULES_"}


def suite_module(suite: str):
    return importlib.import_module(SUITES[suite])


@dataclasses.dataclass
class Selection:
    """Which entries, dtypes and modes of a suite a sweep runs (all of them by default)."""

    suite: str = "opinfo"
    entries: str = ""  # a regular expression an entry id must match (re.search)
    dtypes: tuple[str, ...] = ()  # () for all of the suite's
    modes: tuple[str, ...] = ()

    @classmethod
    def from_env(cls, suite: str = "opinfo") -> Selection:
        """$GG_CONFORMANCE_ENTRIES (regex), $GG_CONFORMANCE_DTYPES and $GG_CONFORMANCE_MODES
        (comma-separated) narrow the OpInfo pytest run while developing; $GG_MODULES_ENTRIES,
        _DTYPES and _MODES the ModuleInfo one; unset, everything."""
        prefix = ENV_PREFIX[suite]

        def listed(name: str) -> tuple[str, ...]:
            value = os.environ.get(prefix + name, "")
            return tuple(value.split(",")) if value else ()

        return cls(suite, os.environ.get(prefix + "ENTRIES", ""), listed("DTYPES"), listed("MODES"))


def plan(selection: Selection) -> list[tuple[str, list[tuple[str, str]]]]:
    """The work: each selected entry with its (dtype, mode) units, in database order."""
    cases = suite_module(selection.suite)
    dtypes = selection.dtypes or tuple(cases.DTYPES)
    modes = selection.modes or cases.MODES
    pattern = re.compile(selection.entries)
    work = []
    for entry, info in cases.load_entries().items():
        units = cases.units_of(info, dtypes, modes)
        if units and pattern.search(entry):
            work.append((entry, units))
    return work


class Child:
    """One worker process of the pool, and the entry it is running."""

    def __init__(self, log_dir: str, index: int, suite: str) -> None:
        self.suite = suite
        self.log_path = os.path.join(log_dir, f"child{index}.log")
        self.proc: subprocess.Popen | None = None
        self.buffer = b""
        self.entry: str | None = None
        self.remaining: list[tuple[str, str]] = []  # units not reported yet
        self.current: tuple[str, str] | None = None  # the unit in flight
        self.deadline = 0.0

    def start(self) -> None:
        env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="")
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--serve"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                cwd=ROOT,
                env=env,
            )
        os.set_blocking(self.proc.stdout.fileno(), False)
        self.buffer = b""

    def assign(self, entry: str, units: list[tuple[str, str]]) -> None:
        self.entry, self.remaining, self.current = entry, list(units), None
        self.deadline = time.monotonic() + START_TIMEOUT
        self.proc.stdin.write(
            json.dumps({"suite": self.suite, "entry": entry, "units": units}).encode() + b"\n"
        )
        self.proc.stdin.flush()

    def stop(self, grace: float = 0.0) -> int:
        """Close its input (a child exits at end of input), wait up to `grace` seconds, then
        kill it if still running; returns the exit status."""
        self.proc.stdin.close()
        try:
            rc = self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            os.kill(self.proc.pid, signal.SIGKILL)
            rc = self.proc.wait()
        self.proc.stdout.close()
        return rc

    def lines(self) -> Iterable[dict] | None:
        """Messages that arrived; None once the child has closed its end (it died)."""
        chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
        if not chunk:
            return None
        self.buffer += chunk
        *complete, self.buffer = self.buffer.split(b"\n")
        return [json.loads(line) for line in complete if line]


def sweep(
    work: list[tuple[str, list[tuple[str, str]]]],
    suite: str = "opinfo",
    processes: int = 2,
    sample_timeout: float | None = None,
    on_outcome: Callable[[Outcome], None] = lambda o: None,
) -> list[Outcome]:
    """Run `work` (from `plan` of `suite`) on `processes` children; one Outcome per unit.
    A sample running past `sample_timeout` (the suite's SAMPLE_TIMEOUTS) is hung."""
    if sample_timeout is None:
        sample_timeout = SAMPLE_TIMEOUTS[suite]
    queue = collections.deque(work)
    outcomes: list[Outcome] = []

    def report(o: Outcome) -> None:
        outcomes.append(o)
        on_outcome(o)

    with tempfile.TemporaryDirectory(prefix="gg-conformance-") as log_dir:
        children = [Child(log_dir, i, suite) for i in range(min(processes, len(work)) or 1)]
        selector = selectors.DefaultSelector()
        for c in children:
            c.start()
            selector.register(c.proc.stdout, selectors.EVENT_READ, c)

        def lost(c: Child, kind: str, message: str) -> None:
            """The child died or hung: fail the unit in flight, restart, requeue the rest."""
            entry = c.entry
            unit = c.current or (c.remaining[0] if c.remaining else None)
            if unit is not None:  # (a child may also die between its last unit and "done")
                report(Outcome(entry, *unit, "fail", kind, message))
            rest = [u for u in c.remaining if u != unit]
            selector.unregister(c.proc.stdout)
            c.stop()
            c.start()
            selector.register(c.proc.stdout, selectors.EVENT_READ, c)
            c.entry = None
            if rest:
                queue.appendleft((entry, rest))

        while True:
            for c in children:
                if c.entry is None and queue:
                    c.assign(*queue.popleft())
            busy = [c for c in children if c.entry is not None]
            if not busy:
                break
            wait = max(0.0, min(c.deadline for c in busy) - time.monotonic())
            for key, _ in selector.select(timeout=wait):
                c = key.data
                messages = c.lines()
                if messages is None:
                    rc = c.proc.wait()
                    lost(c, "crash", f"the process died: {exit_reason(rc)}{last_log_line(c)}")
                    continue
                for m in messages:
                    handle(c, m, sample_timeout, report)
            now = time.monotonic()
            for c in children:
                if c.entry is not None and now > c.deadline:
                    what = "started" if c.current is None else "answered"
                    limit = START_TIMEOUT if c.current is None else sample_timeout
                    lost(c, "timeout", f"hung: not {what} in {limit:.0f} s{last_log_line(c)}")
        for c in children:
            selector.unregister(c.proc.stdout)
            c.stop(grace=30)
    return outcomes


def handle(c: Child, m: dict, sample_timeout: float, report) -> None:
    """One message from a child."""
    if "unit" in m or "sample" in m:
        if "unit" in m:
            c.current = tuple(m["unit"])
        c.deadline = time.monotonic() + sample_timeout
    elif "outcome" in m:
        o = Outcome(**m["outcome"])
        c.remaining.remove((o.dtype, o.mode))
        c.current = None
        report(o)
    elif "done" in m:
        c.entry = None


def exit_reason(rc: int) -> str:
    if rc < 0:
        try:
            return signal.Signals(-rc).name
        except ValueError:
            return f"signal {-rc}"
    return f"exit status {rc}"


def last_log_line(c: Child) -> str:
    try:
        with open(c.log_path, "rb") as f:
            lines = f.read().decode(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return f" ({lines[-1][:200]})" if lines else ""


# --- the child -----------------------------------------------------------------------------


def serve() -> None:
    """Child main loop: one entry per input line, results on the original stdout."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything else printed (by torch, by a kernel) goes to the log
    sys.stdout = sys.stderr

    import torch

    torch.set_num_threads(1)
    entries: dict[str, dict] = {}  # suite -> its entries, loaded at its first request

    def send(message: dict) -> None:
        out.write(json.dumps(message) + "\n")

    for line in sys.stdin:
        request = json.loads(line)
        cases = suite_module(request["suite"])
        if request["suite"] not in entries:
            entries[request["suite"]] = cases.load_entries()
        info = entries[request["suite"]][request["entry"]]
        for dtype, mode in request["units"]:
            send({"unit": [dtype, mode]})
            outcome = cases.run_unit(info, dtype, mode, progress=lambda i: send({"sample": i}))
            send({"outcome": dataclasses.asdict(outcome)})
        send({"done": request["entry"]})


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        serve()
    else:
        sys.exit(
            "run `python -m tests.conformance.report` to sweep;"
            " this file is the sweep's child process (--serve)"
        )
