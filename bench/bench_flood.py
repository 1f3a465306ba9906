"""A trusted client's latency before and during a flood from one outsider Kubo node.

Run: PYTHONPATH=. python bench/bench_flood.py [--seconds 30] [--rate 20]

Starts three loopback Kubo nodes (a temporary swarm, stopped at the end): node 0 runs the
client and worker w0, node 1 worker w1, node 2 the outsider, in a process of its own. The
client connects with `trust=` naming w0 and w1, and times one step again and again: a 64x64
product of a tensor on w0 and one on w1, summed, back to the client. The outsider publishes
~0.9 MB messages whose header is ~900k empty lists (issue 34's attack): an announcement on
the discovery topic and one sealed for w1 on w1's topic, each `--rate` times a second, plus
the bytes unsealed on w1's topic at a quarter of that rate. Prints the step's p95 before
and during the flood, their ratio (the target: at most 3x), and the same during a flood of
as many random bytes, which no one decodes: what the flood costs through Kubo alone (its
nodes sign, check and forward every message). A WorkerLost during a flood ends the run
with it.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # (tests.exec.flood)

import gridgraph as gg  # noqa: E402
from gridgraph.exec.ipfs.discovery import discover  # noqa: E402
from gridgraph.exec.ipfs.swarm import (  # noqa: E402
    spawn_worker,
    start_nodes,
    stop_nodes,
    stop_worker,
)
from tests.exec.flood import finish, latencies, p95, start_outsider  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=30.0, help="length of each flood")
    parser.add_argument("--rate", type=float, default=20.0, help="big messages a second")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gg-bench-flood-") as tmp:
        root = Path(tmp)
        nodes = start_nodes(3, root / "swarm")
        workers = [
            spawn_worker(nodes[i].api, f"w{i}", root / f"w{i}.log", log_level="WARNING")
            for i in range(2)
        ]
        try:
            discover(nodes[0].api, names=["w0", "w1"], timeout=60, procs=workers)
            trust = {"w0": nodes[0].peer_id, "w1": nodes[1].peer_id}
            with gg.connect(ipfs=nodes[0].api, workers=["w0", "w1"], trust=trust) as grid:
                w0, w1 = grid.workers
                a = torch.randn(64, 64)
                x, y = grid.send(a, w0), grid.send(a, w1)

                def step() -> None:
                    assert torch.equal((x @ y).sum().get(), (a @ a).sum())

                latencies(step, 3.0)  # (warm)
                before = p95(latencies(step, args.seconds))
                print(f"p95 before the flood: {1e3 * before:8.1f} ms")
                for random in (False, True):
                    outsider = start_outsider(
                        nodes[2].api, grid.client.identity_of("w1"), "w1", args.seconds,
                        args.rate, random,
                    )  # fmt: skip
                    try:
                        during = p95(latencies(step, args.seconds))
                    finally:
                        sent, failed = finish(outsider)
                    what = "random bytes" if random else "costly headers"
                    print(f"p95 during a flood of {what:14}: {1e3 * during:8.1f} ms  "
                          f"{during / before:5.2f}x   ({sent} messages of 0.9 MB in "
                          f"{args.seconds:g} s, {sent / args.seconds:.1f}/s, "
                          f"{failed} failed)")  # fmt: skip
                    latencies(step, 5.0)  # (Kubo settles)
                print(f"w1 logged {len((root / 'w1.log').read_text().splitlines())} lines")
        finally:
            for worker in workers:
                stop_worker(worker)
            stop_nodes(root / "swarm")


if __name__ == "__main__":
    main()
