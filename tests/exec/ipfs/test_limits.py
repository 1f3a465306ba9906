"""Two clients on real Kubo workers with limits: one breaks them, the other never notices.

Workers run as `gridgraph worker --max-client-memory 1GiB --max-request-seconds 10` (each
client session in an executor process of its own). One client asks for a 4 GiB tensor, then
for a program of about 30 s; it gets an error naming each limit within seconds, and can still
compute afterwards. Meanwhile the other client's small computations stay exact, and stall at
most 1 s (p95) and 3 s (max): a loose behaviour bound, not a benchmark.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import gridgraph as gg
from gridgraph.exec.ipfs.discovery import discover
from gridgraph.exec.ipfs.swarm import stop_worker
from tests.exec.ipfs.fixtures import start_workers, stop_all

pytestmark = pytest.mark.ipfs

NAMES = ["lim0", "lim1"]


@pytest.fixture
def limited_workers(kubo_nodes, tmp_path: Path):
    procs = []
    for node, name in zip(kubo_nodes[1:], NAMES):
        log = open(tmp_path / f"{name}.log", "ab")  # noqa: SIM115 - closed below
        args = [sys.executable, "-m", "gridgraph", "worker", "--ipfs", node.api, "--name", name,
                "--max-client-memory", "1GiB", "--max-request-seconds", "10"]  # fmt: skip
        procs.append((subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT), log))
    try:
        discover(kubo_nodes[0].api, names=NAMES, timeout=90, procs=[p for p, _ in procs])
        yield [p for p, _ in procs]
    finally:
        for proc, log in procs:
            stop_worker(proc)
            log.close()


def test_one_client_breaking_its_limits_does_not_stall_the_other(kubo_nodes, limited_workers):
    api = kubo_nodes[0].api
    with (
        gg.connect(ipfs=api, workers=NAMES, timeout=60) as greedy,
        gg.connect(ipfs=api, workers=NAMES, timeout=60) as steady,
    ):
        a, b = torch.randn(64), torch.randn(64)
        xa, xb = a.send(steady.workers[0]), b.send(steady.workers[1])
        done = threading.Event()
        stalls: list[float] = []
        wrong: list[int] = []

        def small_computations() -> None:
            i = 0
            while not done.is_set():
                start = time.monotonic()
                with gg.trace():
                    y = (xa * i + xb).sum()
                value = y.item()
                stalls.append(time.monotonic() - start)
                if value != pytest.approx((a * i + b).sum().item(), rel=1e-5):
                    wrong.append(i)
                i += 1

        thread = threading.Thread(target=small_computations, daemon=True)
        thread.start()
        try:
            g0 = greedy.workers[0]
            x = torch.ones(4).send(g0)
            start = time.monotonic()
            with pytest.raises(gg.RemoteError, match="memory limit of 1.0 GiB"), gg.trace():
                x[:1].expand(1 << 30).contiguous().compute()  # 4 GiB
                greedy.sync()  # (compute returns once sent)
            assert time.monotonic() - start < 10
            big = torch.randn(1 << 24).send(g0)  # 64 MiB; each op on it takes a while
            with gg.trace():
                y = big
                for _ in range(600):  # about 30 s in all, each step well under the limit
                    y = torch.sin(y) * 1.0001
            start = time.monotonic()
            with pytest.raises(gg.RemoteError, match="time limit of 10 s"):
                y.compute()
                greedy.sync()
            assert time.monotonic() - start < 25
            assert torch.equal((x * 2).get(), torch.full((4,), 2.0))  # still computes
        finally:
            done.set()
            thread.join(30)
        assert not wrong and len(stalls) >= 10
        p95 = statistics.quantiles(stalls, n=20)[-1]
        worst = max(stalls)
        print(f"steady client: {len(stalls)} computations, p95 {p95:.3f} s, max {worst:.3f} s")
        assert p95 < 1.0 and worst < 3.0
    assert all(proc.poll() is None for proc in limited_workers)


def test_a_send_over_a_workers_message_limit_goes_in_pieces_and_nothing_is_dropped(
    kubo_nodes, tmp_path
):
    # A 320 MB send to a worker reading at most 256 MiB hung for ever: the worker dropped
    # it unread, 151 times, while each resend uploaded it again. Here at a smaller scale.
    [small] = start_workers(
        [(kubo_nodes[1], "small")], tmp_path, options=["--max-message-size", "2MiB"]
    )
    try:
        # It announced itself only once it could serve: its executors' forkserver has torch.
        children = Path(f"/proc/{small.proc.pid}/task/{small.proc.pid}/children").read_text()
        maps = [Path(f"/proc/{pid}/maps").read_text() for pid in children.split()]
        assert any("libtorch_cpu" in m for m in maps), children
        with gg.connect(ipfs=kubo_nodes[0].api, workers=["small"], timeout=30) as grid:
            [w] = grid.workers
            limit = grid.client.requests.message_limit("small")
            assert 1.9 * 2**20 < limit < 2 * 2**20  # announced, less the sealing's tags
            a = torch.randn(3, 700, 1000)  # 8.4 MB: five pieces
            b = torch.arange(5.0)
            start = time.monotonic()
            p, q = grid.send_many([a, b], w)
            assert torch.equal(p.get(), a) and torch.equal(q.get(), b)
            assert time.monotonic() - start < 60
            local = torch.randn(600_000)  # 2.4 MB of local tensor mixed into an op
            start = time.monotonic()
            with pytest.raises(gg.GridError, match="over the 2.0 MiB worker 'small' reads"):
                (p.reshape(-1)[:600_000] + local).sum().get()
            assert time.monotonic() - start < 5  # refused before it was sent
            total = p.reshape(-1)[:600_000] + local.send(w)  # sent first: it works
            torch.testing.assert_close(total.get(), a.reshape(-1)[:600_000] + local)
        assert "over this worker's" not in small.log_tail(100_000)  # nothing dropped unread
    finally:
        stop_all([small])
