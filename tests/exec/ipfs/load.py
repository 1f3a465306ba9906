"""Load from many clients at once: client processes, each running many small computations on
threads of its own, against the same Kubo workers. Used by tests/exec/ipfs/test_load.py and
bench/bench_load.py.

One computation: two tensors sent to two different workers, `(x * y + x).sum()` read back,
compared bit for bit with plain torch on the same inputs. A process prints one JSON line:
each computation's seconds and, for a failure, the error's type and message.

Run one client process: python -m tests.exec.ipfs.load API W0,W1,W2 THREADS SEED
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import torch

import gridgraph as gg


def computation(grid: gg.Grid, seed: int) -> None:
    """One small computation over two workers, checked against plain torch."""
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(64, generator=g), torch.randn(64, generator=g)
    n = len(grid.workers)
    x, y = grid.send(a, grid.workers[seed % n]), grid.send(b, grid.workers[(seed + 1) % n])
    got = (x * y + x).sum().get()
    want = (a * b + a).sum()
    if not torch.equal(got, want):
        raise AssertionError(f"computation {seed}: {got.item()!r}, plain torch {want.item()!r}")


def one_client(api: str, workers: list[str], threads: int, seed: int) -> dict:
    """`threads` computations at once on one client of node `api`: what each took or raised."""
    seconds: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()
    with gg.connect(ipfs=api, workers=workers, timeout=120) as grid:
        start = threading.Barrier(threads)

        def run(i: int) -> None:
            start.wait()
            began = time.perf_counter()
            try:
                computation(grid, seed * 10_000 + i)
            except Exception as e:  # (what the test counts: every error is a failure)
                with lock:
                    errors.append(f"{type(e).__name__}: {' | '.join(str(e).splitlines())[:300]}")
            else:
                with lock:
                    seconds.append(time.perf_counter() - began)

        pool = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
    return {"seconds": seconds, "errors": errors}


@dataclass
class Load:
    """What `run_load` saw: every computation's seconds, every error, and the wall time."""

    seconds: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    wall: float = 0.0

    def percentile(self, q: float) -> float:
        ordered = sorted(self.seconds)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def run_load(apis: list[str], workers: list[str], processes: int, threads: int) -> Load:
    """`processes` client processes (spread over the nodes `apis`), `threads` computations
    each, all at once; what they saw. A process that ends without its report counts as
    `threads` errors, with its output's last line."""
    began = time.perf_counter()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.exec.ipfs.load",
                apis[p % len(apis)],
                ",".join(workers),
                str(threads),
                str(p),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for p in range(processes)
    ]
    load = Load()
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        try:
            report = json.loads(out)
        except json.JSONDecodeError:
            last = (err.strip().splitlines() or ["(no output)"])[-1]
            failed = f"process exit {proc.returncode}: {last}"
            report = {"seconds": [], "errors": [failed] * threads}
        load.seconds += report["seconds"]
        load.errors += report["errors"]
    load.wall = time.perf_counter() - began
    return load


if __name__ == "__main__":
    api, names, threads, seed = sys.argv[1:5]
    print(json.dumps(one_client(api, names.split(","), int(threads), int(seed))))
