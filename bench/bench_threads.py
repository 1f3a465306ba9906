"""A small matrix product on a second thread, before and after the main thread used MKL.

Run: python bench/bench_threads.py [--calls 3000]

In-process workers (`gg.local_grid`) run their ops on threads of their own, beside the
user's thread. This prints the median time of a 32x13 @ 13x64 `mm` (the small MLP's first
layer) and of an elementwise op, run on a fresh thread: once in a fresh process, and once in
a process whose main thread did five 512x512 products first, as any user's code does. Each
case runs in a subprocess of its own, since the state that matters (OpenMP thread pools) is
per process.

Seen on this 2-core machine with torch 2.15: the mm goes from about 7 us to about 250 us; the
elementwise op does not change. MKL runs even that mm on all threads (PyTorch turns MKL's
dynamic threading off), and with two threads driving OpenMP the helper threads sleep between
calls, so each call pays to wake them. `torch.set_num_threads(1)` on the second thread
removes it, at the price of big products running on one core there: so a gridgraph worker
runs only its small ops on one thread (gridgraph/exec/worker/intraop.py).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import threading
import time

import torch


def second_thread(op: str, calls: int) -> float:
    """Median microseconds of `op` on a new thread of this process."""
    x, w, y = torch.randn(32, 13), torch.randn(13, 64), torch.randn(32, 64)
    run = (lambda: x @ w) if op == "mm" else (lambda: torch.relu(y) + y)
    times: list[float] = []

    def loop() -> None:
        for _ in range(200):
            run()
        for _ in range(calls):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)

    thread = threading.Thread(target=loop)
    thread.start()
    thread.join()
    return 1e6 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--case", nargs=2, help=argparse.SUPPRESS)  # op, main-thread-first
    args = parser.parse_args()
    if args.case:
        op, first = args.case
        if first == "yes":
            a = torch.randn(512, 512)
            for _ in range(5):
                a @ a
        print(second_thread(op, args.calls))
        return
    print(f"on a second thread (median of {args.calls} calls): fresh process, after main-thread mm")
    for op, name in (("mm", "32x13 @ 13x64 mm"), ("relu", "relu(y) + y, 32x64")):
        fresh, after = (
            float(subprocess.check_output(
                [sys.executable, __file__, "--calls", str(args.calls), "--case", op, first]
            ))
            for first in ("no", "yes")
        )  # fmt: skip
        print(f"  {name:20s} {fresh:8.1f} us  {after:8.1f} us  {after / fresh:6.1f}x")


if __name__ == "__main__":
    main()
