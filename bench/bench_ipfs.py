"""gridgraph over Kubo next to raw Kubo, between the same two nodes, in one run.

Run: python bench/bench_ipfs.py [--rounds 50] [--mb 10]

Starts two loopback Kubo nodes (a temporary swarm, stopped at the end) and one worker on
node 1; the client and the raw calls use node 0. Prints:
  - round trip of one gridgraph batch (one `run` message to the worker, its reply) next to a
    raw Kubo pubsub round trip (pub on node 0, echoed by a subscriber on node 1), as a ratio;
  - tensor throughput, client -> worker (`send`) and worker -> client (`get`), next to raw
    `block put` on one node + `block get` on the other of the same bytes in 512 KiB blocks
    (as the transport cuts them, 8 fetches in flight), as ratios.
Medians over the rounds; every payload is fresh random bytes, so no block is already there.
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
from gridgraph.exec.ipfs.swarm import spawn_worker, start_nodes, stop_nodes, stop_worker
from gridgraph.exec.ipfs.transport import BLOCK_SIZE, FETCH_PARALLELISM


def median_ms(samples: list[float]) -> float:
    return 1000 * statistics.median(samples)


def raw_pubsub_rtt(near: Kubo, far: Kubo, rounds: int) -> tuple[list[float], int]:
    """Round trips of a small message: pub on `near`, echoed back by a reader on `far`."""
    ping = far.pubsub_sub("bench.ping")
    pong = near.pubsub_sub("bench.pong")
    inbox: queue.Queue[bytes] = queue.Queue()

    def echo() -> None:
        for message in ping:
            far.pubsub_pub("bench.pong", message.data)

    def collect() -> None:
        for message in pong:
            inbox.put(message.data)

    for target in (echo, collect):
        threading.Thread(target=target, daemon=True).start()
    while not near.pubsub_peers("bench.ping") or not far.pubsub_peers("bench.pong"):
        time.sleep(0.05)
    samples, lost = [], 0
    try:
        for i in range(rounds + 5):
            token = os.urandom(16)
            start = time.perf_counter()
            near.pubsub_pub("bench.ping", token)
            try:
                while inbox.get(timeout=2.0) != token:
                    pass
            except queue.Empty:
                lost += 1  # PubSub is best effort: Kubo drops a message now and then
                continue
            if i >= 5:  # warm-up
                samples.append(time.perf_counter() - start)
    finally:
        ping.close()
        pong.close()
    return samples, lost


def gridgraph_rtt(grid: gg.Grid, rounds: int) -> list[float]:
    """Round trips of one batch: `y = x + 1` computed on the worker (one run, one reply)."""
    x = torch.ones(4).send(grid.workers[0])
    samples = []
    for i in range(rounds + 5):
        with gg.trace():
            y = x + 1
        start = time.perf_counter()
        gg.compute(y)
        if i >= 5:  # warm-up, and the plan is cached: later runs send only ids
            samples.append(time.perf_counter() - start)
    return samples


def raw_blocks(put_on: Kubo, get_on: Kubo, nbytes: int, rounds: int) -> list[float]:
    """block put of `nbytes` fresh bytes on one node, then block get of them on the other."""
    samples = []
    with ThreadPoolExecutor(FETCH_PARALLELISM) as pool:
        for _ in range(rounds):
            data = os.urandom(nbytes)
            start = time.perf_counter()
            cids = [put_on.block_put(data[i : i + BLOCK_SIZE])
                    for i in range(0, nbytes, BLOCK_SIZE)]  # fmt: skip
            got = b"".join(pool.map(get_on.block_get, cids))
            samples.append(time.perf_counter() - start)
            assert got == data
    return samples


def gridgraph_transfer(grid: gg.Grid, nbytes: int, rounds: int) -> tuple[list, list]:
    """send (client -> worker) and get (worker -> client) of a fresh float32 tensor."""
    sends, gets = [], []
    for _ in range(rounds):
        t = torch.randn(nbytes // 4)
        start = time.perf_counter()
        p = t.send(grid.workers[0])
        sent = time.perf_counter()
        back = p.get()
        sends.append(sent - start)
        gets.append(time.perf_counter() - sent)
        assert torch.equal(back, t)
    return sends, gets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=50, help="round trips to time")
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
            raw_rtt, lost = raw_pubsub_rtt(kn, kf, args.rounds)
            raw_up = raw_blocks(kn, kf, nbytes, args.transfers)
            raw_down = raw_blocks(kf, kn, nbytes, args.transfers)
            with gg.connect(ipfs=near.api, workers=["bench"]) as grid:
                gg_rtt = gridgraph_rtt(grid, args.rounds)
                gg_up, gg_down = gridgraph_transfer(grid, nbytes, args.transfers)
        finally:
            stop_worker(worker)
            stop_nodes(root / "swarm")

    mb = nbytes / 1e6
    print(f"\nround trip (median of {args.rounds})      gridgraph     raw Kubo    ratio")
    print(
        f"  one batch vs pubsub echo       {median_ms(gg_rtt):8.2f} ms  "
        f"{median_ms(raw_rtt):8.2f} ms  {median_ms(gg_rtt) / median_ms(raw_rtt):6.2f}x"
        + (f"   ({lost} raw echoes lost)" if lost else "")
    )
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
