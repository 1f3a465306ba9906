"""A flood from a second peer on a local grid's bus: messages whose header costs time to
decode, 20 a second, on a worker's topic and on the client's reply topic. Of them the worker
decodes a few at most, the client none; the client's results stay exact and the logs
bounded. (The latency target, p95 within 3x, is a ratio: bench/bench_flood.py prints it.)

Before, each 0.9 MB header of empty lists was decoded whole (90-290 ms, holding the lock)
before any check; now the worker checks its sender's rate of header bytes first (and
decodes what passes at a bounded cost), and the client drops what no worker it asked sent.
"""

from __future__ import annotations

import torch

import gridgraph as gg
from gridgraph.exec import wire
from gridgraph.exec.protocol import client_topic, worker_topic
from gridgraph.exec.safety.limits import Limits
from tests.exec.flood import Flood, LineCounter, costly, latencies, p95
from tests.exec.local_peer import Peer


def test_a_flood_of_costly_headers_from_a_second_peer_is_decoded_a_few_times_at_most(
    monkeypatch,
):
    # The limits `gridgraph worker` grants, but for a request rate this fast loop stays under
    limits = Limits(requests_per_second=10_000, request_burst=10_000)
    with gg.local_grid(2, limits=limits) as grid:
        w0, w1 = grid.workers
        a = torch.randn(64, 64)
        x, y = grid.send(a, w0), grid.send(a, w1)

        def step() -> None:
            assert torch.equal((x @ y).sum().get(), (a @ a).sum())

        latencies(step, 1.0)  # (warm)
        before = latencies(step, 3.0)
        client = grid.client
        mallory = client.transport._bus.endpoint("mallory")
        request, reply = costly("ping"), costly("reply")
        replies = client_topic(client.transport.identity, client.session)
        flood = Flood([
            lambda: mallory.publish(worker_topic("w0"), request),
            lambda: mallory.publish(replies, reply),
        ])  # fmt: skip
        decoded = []  # sizes of the messages anyone here decoded during the flood
        decode = wire.decode

        def counting(payload, *args, **kwargs):
            decoded.append(len(payload))
            return decode(payload, *args, **kwargs)

        monkeypatch.setattr(wire, "decode", counting)
        with LineCounter() as lines:
            flood.start()
            try:
                during = latencies(step, 6.0)
            finally:
                flood.stop()
        assert flood.sent >= 200, flood.sent  # 20 a second on each topic
        costly_decoded = sum(size >= len(request) // 2 for size in decoded)
        assert costly_decoded <= 4, costly_decoded  # (before: every one, on both topics)
        print(f"p95 {1e3 * p95(before):.1f} ms before, {1e3 * p95(during):.1f} ms during")
        assert lines.count <= 25, lines.count


def test_a_peer_whose_header_is_refused_for_its_containers_waits_before_its_next_is_decoded():
    # Within its rate of header bytes, a peer still made a worker decode a costly header each
    # second (~40-70 ms of its lock each, more on a loaded machine). No honest peer makes
    # one: it now costs the peer COSTLY_HEADER_CHARGE times its size.
    with gg.local_grid(1, limits=Limits()) as grid:
        mallory, bob = Peer(grid, "mallory"), Peer(grid, "bob")
        assert mallory.request("w0", {"kind": "ping"})["ok"]
        for _ in range(2):  # 0.1 MB each: 1.6 MB charged each, 2 MiB allowed at once
            mallory.publish("w0", costly("ping", 100_000))
        mallory.send("w0", {"kind": "ping"})
        assert bob.request("w0", {"kind": "ping"})["ok"]  # others are served
        assert mallory.no_reply_within(0.5), "its ping was decoded within its penalty"
