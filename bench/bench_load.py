"""Many clients at once on three Kubo workers: errors, throughput and latency.

Run: PYTHONPATH=. python bench/bench_load.py [--processes 8] [--threads 100]

Starts three loopback Kubo nodes with a worker each (a temporary swarm, stopped at the end),
then `--processes` client processes, spread over the nodes, each running `--threads`
computations at once (tests/exec/ipfs/load.py: two tensors sent to two workers, a product
and a sum read back, compared bit for bit with plain torch). Prints how many failed and
why (the target: none), the computations a second, and their p50 and p99 latency.
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # (tests.exec.ipfs.load)

from gridgraph.exec.ipfs.swarm import local_swarm  # noqa: E402
from tests.exec.ipfs.load import run_load  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=8, help="client processes")
    parser.add_argument("--threads", type=int, default=100, help="computations per process")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gg-bench-load-") as tmp:
        with local_swarm(3, Path(tmp), log_level="WARNING") as apis:
            load = run_load(apis, ["w0", "w1", "w2"], args.processes, args.threads)
    total = args.processes * args.threads
    print(f"{args.processes} processes x {args.threads} threads on 3 Kubo workers: "
          f"{len(load.seconds)} of {total} exact, {len(load.errors)} failed")  # fmt: skip
    for error, count in collections.Counter(load.errors).most_common(5):
        print(f"  {count:4d} x {error}")
    print(f"throughput {len(load.seconds) / load.wall:.1f} computations/s "
          f"({load.wall:.1f} s wall, client start-up included)")  # fmt: skip
    print(f"latency p50 {1e3 * load.percentile(0.5):.0f} ms, "
          f"p99 {1e3 * load.percentile(0.99):.0f} ms")  # fmt: skip


if __name__ == "__main__":
    main()
