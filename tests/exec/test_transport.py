"""The LocalBus (transport.py): who a message is delivered to."""

from __future__ import annotations

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
    assert sender.recipient("gridgraph.worker.w1") is None  # two: none is the recipient
