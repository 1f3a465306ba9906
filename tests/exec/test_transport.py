"""The LocalBus (transport.py): who a message is delivered to."""

from __future__ import annotations

import pytest
import torch

import gridgraph as gg
from gridgraph.exec.protocol import worker_topic
from gridgraph.exec.transport import LocalBus


def test_a_message_published_to_an_identity_reaches_that_endpoint_only():
    bus = LocalBus()
    heard: dict[str, list[tuple[str, bytes]]] = {"box-1": [], "w1": []}
    for identity, got in heard.items():  # two endpoints on one worker topic
        bus.endpoint(identity).subscribe(
            "gridgraph.worker.w1", lambda s, p, got=got: got.append((s, p))
        )
    sender = bus.endpoint("w0")
    sender.publish("gridgraph.worker.w1", b"for box-1", to="box-1")
    assert heard == {"box-1": [("w0", b"for box-1")], "w1": []}
    sender.publish("gridgraph.worker.w1", b"for all")  # no identity: every subscriber
    assert heard["box-1"][-1] == heard["w1"][-1] == ("w0", b"for all")
    with pytest.raises(gg.GridError, match="'box-1', 'w1'"):  # two: none is the recipient
        sender.recipient("gridgraph.worker.w1")


def test_a_second_peer_claiming_a_workers_name_on_the_bus_is_refused_not_picked():
    # On the bus a request with no known recipient went to every subscriber of the topic:
    # a second endpoint subscribed to w0's topic read the client's tensors.
    with gg.local_grid(1) as grid:
        a = torch.randn(4)
        x = grid.send(a, grid.workers[0])
        heard: list[bytes] = []
        mallory = grid.client.transport._bus.endpoint("mallory")
        mallory.subscribe(worker_topic("w0"), lambda sender, payload: heard.append(payload))
        with pytest.raises(gg.GridError, match="'mallory', 'w0'.*will not pick one"):
            grid.send(a, grid.workers[0])
        assert heard == []
        mallory.close()
        assert torch.equal((x + 1).get(), a + 1)
