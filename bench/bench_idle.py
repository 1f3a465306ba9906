"""What waiting costs the next op: one small ATen op, hot and right after the thread idled.

Run: python bench/bench_idle.py [--samples 300]

A round trip over PubSub leaves every process on its path idle for milliseconds (the client
while Kubo delivers, the worker between requests, an executor between programs), and the
first work after such a wait runs on a cold core. This prints the median time of one
`aten::add.Tensor` on 4 floats: back to back, after sleeping (0.3 ms and 3 ms, the gaps of a
round trip), and after 3 ms of busy Python (the core stays awake, the caches are refilled by
other work). bench_ipfs.py's gridgraph-over-raw ratio is made of such cold work: every
step a message takes through gridgraph's code (crypto, checks, the op itself) pays it,
while a raw echo runs almost none.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def op_after(pause, samples: int) -> float:
    """Median microseconds of one small add, each run right after `pause()`."""
    x, add = torch.ones(4), torch.ops.aten.add.Tensor
    times = []
    for _ in range(samples):
        pause()
        start = time.perf_counter()
        add(x, 1)
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=300)
    n = parser.parse_args().samples
    hot = op_after(lambda: None, n)
    print(f"one add on 4 floats (median of {n})")
    print(f"  back to back               {hot:7.1f} us")
    for name, pause in (
        ("after sleeping 0.3 ms", lambda: time.sleep(0.0003)),
        ("after sleeping 3 ms", lambda: time.sleep(0.003)),
        ("after 3 ms of busy Python", lambda: busy(0.003)),
    ):
        cold = op_after(pause, n)
        print(f"  {name:26s} {cold:7.1f} us  {cold / hot:5.1f}x")


if __name__ == "__main__":
    main()
