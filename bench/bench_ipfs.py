"""gridgraph over Kubo next to raw Kubo, between the same two nodes, in one run.

Run: python bench/bench_ipfs.py [--rounds 300] [--mb 10]

Starts two loopback Kubo nodes (a temporary swarm, stopped at the end) and one worker on
node 1; the client and the raw calls use node 0. Prints:
  - round trip of one gridgraph batch (one `run` message to the worker, its reply) next to a
    raw Kubo pubsub round trip (pub on node 0, echoed by a subscriber on node 1), as a ratio;
    then the same with that worker stopped and one started with `--no-isolate` in its place,
    which shows what isolation costs (a request and its reply cross into the session's
    executor process and back);
  - the CPU time (user + system, all threads) each process spends per round trip, over a
    block of batches and then a block of echoes (on Linux; the client's share of a batch
    includes recording its `x + 1`, which the round trip above does not time). On a small
    machine a round trip's steps run one after another, so CPU spent anywhere on the way
    is wall time: this shows where it goes;
  - tensor throughput, client -> worker (`send`) and worker -> client (`get`), next to raw
    `block put` on one node + `block get` on the other of the same bytes in 512 KiB blocks
    (as the transport cuts them, 8 fetches in flight), as ratios.
Raw and gridgraph samples alternate, so both see the same load (the machine may be shared);
medians over the rounds; every payload is fresh random bytes, so no block is already there.
Next to each round-trip ratio: its lowest and highest over blocks of BLOCK rounds, which shows
how far a ratio moves within one run (runs on a small shared machine differ by about 0.02x).
gridgraph encrypts every message and block end to end (gridgraph.exec.ipfs.secure); the raw
calls move plaintext.
"""

from __future__ import annotations

import argparse
import os
import queue
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

import gridgraph as gg
from gridgraph.exec.ipfs.discovery import discover
from gridgraph.exec.ipfs.kubo import Kubo, KuboError
from gridgraph.exec.ipfs.swarm import (
    spawn_worker,
    start_nodes,
    stat_fields,
    stop_nodes,
    stop_worker,
)
from gridgraph.exec.ipfs.transport import BLOCK_SIZE, FETCH_WINDOW

BLOCK = 50  # rounds per block, for the spread of a round-trip ratio


def median_ms(samples: list[float]) -> float:
    return 1000 * statistics.median(samples)


def ratio_line(ours: list[float], raw: list[float]) -> str:
    """Medians of alternated samples, their ratio, and the ratio's range over blocks."""
    blocks = [
        statistics.median(ours[i : i + BLOCK]) / statistics.median(raw[i : i + BLOCK])
        for i in range(0, len(ours) - BLOCK + 1, BLOCK)
    ]
    spread = f"   (blocks of {BLOCK}: {min(blocks):.2f}-{max(blocks):.2f})" if blocks else ""
    return (
        f"{median_ms(ours):8.2f} ms  {median_ms(raw):8.2f} ms  "
        f"{median_ms(ours) / median_ms(raw):6.3f}x{spread}"
    )


class Echo:
    """A raw Kubo pubsub round trip: pub on `near`, echoed back by a reader on `far`."""

    def __init__(self, near: Kubo, far: Kubo) -> None:
        self.near = near
        self.ping, self.pong = far.pubsub_sub("bench.ping"), near.pubsub_sub("bench.pong")
        self.inbox: queue.Queue[bytes] = queue.Queue()
        self.lost = 0

        def echo() -> None:
            for message in self.ping:
                far.pubsub_pub("bench.pong", message.data)

        def collect() -> None:
            for message in self.pong:
                self.inbox.put(message.data)

        for target in (echo, collect):
            threading.Thread(target=target, daemon=True).start()
        while not near.pubsub_peers("bench.ping") or not far.pubsub_peers("bench.pong"):
            time.sleep(0.05)

    def once(self) -> float | None:
        """Seconds for one round trip; None if PubSub lost it (best effort)."""
        token = os.urandom(16)
        start = time.perf_counter()
        self.near.pubsub_pub("bench.ping", token)
        try:
            while self.inbox.get(timeout=2.0) != token:
                pass
        except queue.Empty:
            self.lost += 1
            return None
        return time.perf_counter() - start

    def close(self) -> None:
        self.ping.close()
        self.pong.close()


def batch_once(x: torch.Tensor) -> float:
    """Seconds for one batch: `y = x + 1` computed on the worker (one run, one reply)."""
    with gg.trace():
        y = x + 1
    start = time.perf_counter()
    gg.compute(y)
    return time.perf_counter() - start


def round_trips(echo: Echo, grid: gg.Grid, rounds: int) -> tuple[list, list]:
    """(gridgraph, raw) seconds of `rounds` batches on the grid's one worker and as many
    echoes, alternating so that both see the same machine load."""
    raw_rtt, gg_rtt = [], []
    x = torch.ones(4).send(grid.workers[0])
    for i in range(rounds + 5):
        raw, ours = echo.once(), batch_once(x)
        if i >= 5 and raw is not None:  # warm-up; later runs reuse the plan
            raw_rtt.append(raw)
            gg_rtt.append(ours)
    return gg_rtt, raw_rtt


def cpu_seconds(pids: list[int]) -> float:
    """CPU seconds (user + system, all threads) the processes `pids` used so far."""
    ticks = 0
    for pid in pids:
        fields = stat_fields(pid)
        if fields is not None:
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def descendants(pid: int) -> list[int]:
    """The processes below `pid` (a worker's forkserver and executors)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        fields = stat_fields(entry.name) if entry.name.isdigit() else None
        if fields is not None:
            parents[int(entry.name)] = int(fields[1])
    found, frontier = [], [pid]
    while frontier:
        below = [p for p, parent in parents.items() if parent in frontier]
        found += below
        frontier = below
    return found


def cpu_per_round_trip(roles: dict[str, list[int]], once, rounds: int) -> dict[str, float]:
    """Milliseconds of CPU each role's processes spend per call of `once`, and the wall."""
    before, start = {r: cpu_seconds(p) for r, p in roles.items()}, time.perf_counter()
    for _ in range(rounds):
        once()
    wall = time.perf_counter() - start
    used = {r: 1000 * (cpu_seconds(p) - before[r]) / rounds for r, p in roles.items()}
    return {**used, "total": sum(used.values()), "wall": 1000 * wall / rounds}


def raw_blocks_once(put_on: Kubo, get_on: Kubo, nbytes: int, pool: ThreadPoolExecutor) -> float:
    """block put of `nbytes` fresh bytes on one node, then block get of them on the other."""
    data = os.urandom(nbytes)
    start = time.perf_counter()
    cids = [put_on.block_put(data[i : i + BLOCK_SIZE]) for i in range(0, nbytes, BLOCK_SIZE)]
    got = b"".join(pool.map(get_on.block_get, cids))
    elapsed = time.perf_counter() - start
    assert got == data
    return elapsed


def send_get_once(grid: gg.Grid, nbytes: int) -> tuple[float, float]:
    """send (client -> worker) and get (worker -> client) of a fresh float32 tensor."""
    t = torch.randn(nbytes // 4)
    start = time.perf_counter()
    p = t.send(grid.workers[0])
    sent = time.perf_counter()
    back = p.get()
    done = time.perf_counter()
    assert torch.equal(back, t)
    return sent - start, done - sent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=300, help="round trips to time")
    parser.add_argument("--mb", type=float, default=10, help="tensor size for throughput")
    parser.add_argument("--transfers", type=int, default=5, help="transfers to time")
    args = parser.parse_args()
    nbytes = int(args.mb * 1e6) // 4 * 4
    with tempfile.TemporaryDirectory(prefix="gg-bench-") as tmp:
        root = Path(tmp)
        t0 = time.perf_counter()
        near, far = start_nodes(2, root / "swarm")
        worker = spawn_worker(far.api, "bench", root / "worker.log", log_level="WARNING")
        try:
            discover(near.api, names=["bench"], timeout=60, procs=[worker])
            print(
                f"2 Kubo nodes + 1 worker up in {time.perf_counter() - t0:.1f} s "
                f"(Kubo {Kubo(near.api).version()}); client on node 0, worker on node 1"
            )
            kn, kf = Kubo(near.api), Kubo(far.api)
            echo = Echo(kn, kf)
            raw_up, raw_down, gg_up, gg_down = [], [], [], []
            with gg.connect(ipfs=near.api, workers=["bench"]) as grid:
                gg_rtt, raw_rtt = round_trips(echo, grid, args.rounds)
                roles = {
                    "client": [os.getpid()],
                    "worker": [worker.pid],
                    "executor": descendants(worker.pid),
                    "Kubo": [near.pid, far.pid],
                }
                x = torch.ones(4).send(grid.workers[0])
                cpu = {}
                if Path("/proc/self/stat").exists():
                    cpu["gridgraph batch"] = cpu_per_round_trip(
                        roles, lambda: batch_once(x), args.rounds
                    )
                    cpu["raw pubsub echo"] = cpu_per_round_trip(roles, echo.once, args.rounds)
                with ThreadPoolExecutor(FETCH_WINDOW) as pool:
                    for _ in range(args.transfers):
                        raw_up.append(raw_blocks_once(kn, kf, nbytes, pool))
                        raw_down.append(raw_blocks_once(kf, kn, nbytes, pool))
                        up, down = send_get_once(grid, nbytes)
                        gg_up.append(up)
                        gg_down.append(down)
            # The same round trips on a worker without executors, alone on the machine too.
            stop_worker(worker)
            worker = spawn_worker(far.api, "shared", root / "shared.log", log_level="WARNING",
                                  isolate=False)  # fmt: skip
            discover(near.api, names=["shared"], timeout=60, procs=[worker])
            with gg.connect(ipfs=near.api, workers=["shared"]) as grid:
                shared_rtt, shared_raw = round_trips(echo, grid, args.rounds)
            lost = echo.lost
            echo.close()
        finally:
            stop_worker(worker)
            stop_nodes(root / "swarm")

    mb = nbytes / 1e6
    print(f"\nround trip (median of {args.rounds})      gridgraph     raw Kubo    ratio")
    print(
        f"  one batch vs pubsub echo       {ratio_line(gg_rtt, raw_rtt)}"
        + (f"   ({lost} raw echoes lost)" if lost else "")
    )
    print(f"  the same, --no-isolate         {ratio_line(shared_rtt, shared_raw)}")
    if cpu:
        print(f"\nCPU per round trip, ms (blocks of {args.rounds}, not alternated)")
        print("                        client  worker executor  Kubo x2   total    wall")
        for name, used in cpu.items():
            print(f"  {name:20s}" + "".join(f"{used[r]:8.2f}" for r in (*roles, "total", "wall")))
    print(f"\n{mb:g} MB tensor (median of {args.transfers})   gridgraph     raw Kubo    ratio")
    for name, ours, raw in (("send: client -> worker", gg_up, raw_up),
                            ("get:  worker -> client", gg_down, raw_down)):  # fmt: skip
        o, r = statistics.median(ours), statistics.median(raw)
        print(f"  {name}        {mb / o:7.1f} MB/s {mb / r:7.1f} MB/s  {o / r:6.2f}x time")
    print("\nratio > 1: gridgraph takes that many times as long as the raw Kubo calls")


if __name__ == "__main__":
    try:
        main()
    except KuboError as error:
        raise SystemExit(f"error: {error}") from None
