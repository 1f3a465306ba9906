"""The Kubo RPC client against real daemons: pubsub encoding, identity, blocks."""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from gridgraph.exec.ipfs.kubo import MAX_BLOCK_SIZE, Kubo, PubsubMessage

pytestmark = [
    pytest.mark.ipfs,
    # ipfshttpclient 0.7.0 passes `strict=` to urllib3 (pytest resets kubo.py's filter)
    pytest.mark.filterwarnings("ignore:The 'strict' parameter:FutureWarning"),
]

EVERY_BYTE = bytes(range(256)) * 4


def wait_for_subscriber(kubo: Kubo, topic: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not kubo.pubsub_peers(topic):
        assert time.monotonic() < deadline, f"no subscriber on {topic!r} after {timeout}s"
        time.sleep(0.02)


def test_version_and_id(kubo_nodes):
    kubo = Kubo(kubo_nodes[0].api)
    assert kubo.version() == "0.43.1"
    assert kubo.id() == kubo_nodes[0].peer_id
    assert set(kubo.swarm_peers()) == {n.peer_id for n in kubo_nodes[1:]}


def test_pubsub_round_trip_every_byte_value(kubo_nodes):
    publisher, subscriber = Kubo(kubo_nodes[0].api), Kubo(kubo_nodes[1].api)
    topic = f"test/{uuid.uuid4()} with spaces & ünïcode"
    stream = subscriber.pubsub_sub(topic)
    received: list[PubsubMessage] = []
    reader = threading.Thread(target=lambda: received.extend([next(iter(stream))]))
    reader.start()
    wait_for_subscriber(publisher, topic)
    publisher.pubsub_pub(topic, EVERY_BYTE)
    reader.join(timeout=10)
    stream.close()
    assert len(received) == 1
    assert received[0].data == EVERY_BYTE
    assert received[0].sender == kubo_nodes[0].peer_id  # signed: the publisher's identity
    assert len(received[0].seqno) == 8


def test_subscription_close_unblocks_reader(kubo_nodes):
    stream = Kubo(kubo_nodes[0].api).pubsub_sub(f"test/{uuid.uuid4()}")
    reader = threading.Thread(target=lambda: list(stream))
    reader.start()
    time.sleep(0.1)
    stream.close()
    reader.join(timeout=5)
    assert not reader.is_alive()


def test_block_put_then_get_from_another_node(kubo_nodes):
    data = EVERY_BYTE + uuid.uuid4().bytes  # unique, so node 1 cannot already have it
    cid = Kubo(kubo_nodes[0].api).block_put(data)
    assert cid.startswith("bafkrei")  # CIDv1, raw codec, sha2-256
    assert Kubo(kubo_nodes[1].api).block_get(cid, timeout=10) == data


def test_block_put_refuses_more_than_1_mib(kubo_nodes):
    kubo = Kubo(kubo_nodes[0].api)
    kubo.block_put(b"x" * MAX_BLOCK_SIZE)
    with pytest.raises(ValueError, match="exceeds"):
        kubo.block_put(b"x" * (MAX_BLOCK_SIZE + 1))
