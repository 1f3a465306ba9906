"""Where a local swarm's start and stop go: what `python examples/multinode_demo.py` waits
for outside training.

Run: python bench/bench_swarm_start.py [--workers 3] [--rounds 3]

Each round, in a fresh directory: the Kubo nodes up (repos made, daemons answering as
themselves, connected), each worker from its start until a client hears it announce (it
announces once its executors' forkserver serves: torch imported twice, once by the worker
and once by the forkserver), a client connecting (`gg.connect`, which listens one
heartbeat for rival names), the workers stopped (SIGTERM until they exit) and the nodes
stopped. The times are per round; the medians come last. On a machine of 2 cores the
workers' start is mostly CPU: 3 workers import torch 6 times.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import gridgraph as gg
from gridgraph.exec.ipfs.discovery import discover
from gridgraph.exec.ipfs.swarm import spawn_worker, start_nodes, stop_nodes, stop_worker

PHASES = ("nodes", "workers heard", "connect", "workers stopped", "nodes stopped")


def one_round(n: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="gg-bench-swarm-") as tmp:
        root = Path(tmp)
        procs, spawned = [], {}

        def start_worker(node) -> None:
            spawned[node.index] = time.perf_counter()
            procs.append(spawn_worker(node.api, f"w{node.index}", root / f"w{node.index}.log"))

        t0 = time.perf_counter()
        try:
            nodes = start_nodes(n, root, on_ready=start_worker)
            t1 = time.perf_counter()
            discover(nodes[0].api, names=[f"w{i}" for i in range(n)], timeout=300, procs=procs)
            t2 = time.perf_counter()
            with gg.connect(ipfs=nodes[0].api, min_workers=n):
                t3 = time.perf_counter()
        finally:
            t4 = time.perf_counter()
            for proc in procs:
                proc.terminate()
            for proc in procs:
                stop_worker(proc)
            t5 = time.perf_counter()
            stop_nodes(root)
            t6 = time.perf_counter()
    first = min(spawned.values())
    return {
        "nodes": t1 - t0,
        "workers heard": t2 - first,
        "connect": t3 - t2,
        "workers stopped": t5 - t4,
        "nodes stopped": t6 - t5,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print("round " + "".join(f"{p:>17}" for p in PHASES) + "  (s)")
    rounds = []
    for r in range(args.rounds):
        rounds.append(one_round(args.workers))
        print(f"{r:5d} " + "".join(f"{rounds[-1][p]:17.2f}" for p in PHASES), flush=True)
    medians = {p: statistics.median(t[p] for t in rounds) for p in PHASES}
    print("median" + "".join(f"{medians[p]:17.2f}" for p in PHASES))


if __name__ == "__main__":
    main()
