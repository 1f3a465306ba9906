"""A worker's network process under a flood from hostile peers: its cap, what it accounted,
how much its memory grew, and how a victim's requests fared.

Run: PYTHONPATH=. python bench/bench_worker_memory.py [--cap-mib 32] [--peers 8] [--size-kib 512]

An in-process grid of two workers (the local bus; each hostile peer an identity of its own)
with `max_worker_memory` set to the cap. Each peer opens 4 sessions on the target whose
first request is a `recv` nobody satisfies, queues 4 puts behind it and sends 5 transfers no
run named (tests/exec/worker/flood.py). Printed: bytes sent, bytes the worker's budget
accounted (all peers, and the most one peer held, against its share), this process's RSS
growth, and the victim's round trip (a small exact computation, compared with torch) before
and during the flood: median and worst of 10.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

from tests.exec.worker.arena import local_arena
from tests.exec.worker.flood import MiB, flood, local_worker, rss


def _round_trips(arena, n: int = 10) -> list[float]:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        arena.check()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cap-mib", type=int, default=32)
    ap.add_argument("--peers", type=int, default=8)
    ap.add_argument("--size-kib", type=int, default=512)
    args = ap.parse_args()
    logging.disable(logging.WARNING)  # (a line per refusal)
    cap = args.cap_mib * MiB
    arenas = local_arena(max_worker_memory=cap, max_request_seconds=120.0)
    arena = next(arenas)
    worker = local_worker(arena)
    _round_trips(arena, 2)  # (the first prepares the victim's program)
    quiet = _round_trips(arena)
    before = rss()
    attack = flood(arena, peers=args.peers, size=args.size_kib << 10)
    grown = rss() - before
    held = worker.budget.held()
    most = max(worker.budget.held(p.transport.identity) for p in attack.attackers)
    loud = _round_trips(arena)
    attack.stop()
    print(f"{args.peers} hostile peers, {attack.sent / MiB:.0f} MiB sent; "
          f"{len(attack.refusals)} requests refused naming max_worker_memory")  # fmt: skip
    print(f"cap {cap / MiB:.0f} MiB: accounted {held / MiB:.1f} MiB; one peer at most "
          f"{most / MiB:.2f} MiB of its {worker.budget.share / MiB:.2f} MiB share")  # fmt: skip
    print(f"RSS of this process grew {grown / MiB:.1f} MiB")
    for label, times in (("before", quiet), ("during", loud)):
        print(f"victim round trip {label} the flood: median {statistics.median(times) * 1e3:.1f}"
              f" ms, worst {max(times) * 1e3:.1f} ms")  # fmt: skip
    next(arenas, None)  # (closes the grid)


if __name__ == "__main__":
    main()
