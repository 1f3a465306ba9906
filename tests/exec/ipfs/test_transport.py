"""IpfsTransport over real Kubo daemons: identity, inline and block payloads, dedup, garbage,
bogus blocks; GridTransport removing the blocks it sent."""

from __future__ import annotations

import os
import queue
import time
import uuid
from collections.abc import Iterator

import pytest

from gridgraph.exec import wire
from gridgraph.exec.ipfs.discovery import Directory
from gridgraph.exec.ipfs.kubo import Kubo
from gridgraph.exec.ipfs.swarm import NodeInfo
from gridgraph.exec.ipfs.transport import (
    ACK_PREFIX,
    ASSEMBLERS,
    INLINE_MAX,
    PENDING_PER_PEER,
    GridTransport,
    IpfsTransport,
    pack_blocks,
)
from gridgraph.exec.protocol import worker_topic
from gridgraph.exec.safety.budget import MemoryBudget
from tests.exec.ipfs.fixtures import Inbox

pytestmark = pytest.mark.ipfs


@pytest.fixture
def transports(kubo_nodes: list[NodeInfo]) -> Iterator[list[IpfsTransport]]:
    endpoints = [IpfsTransport(node.api) for node in kubo_nodes]
    yield endpoints
    for endpoint in endpoints:
        endpoint.close()


@pytest.fixture
def topic() -> str:
    return f"test/{uuid.uuid4()}"


def test_identity_is_the_peer_id(transports, kubo_nodes):
    assert [t.identity for t in transports] == [n.peer_id for n in kubo_nodes]


def test_small_payload_round_trip(transports, topic):
    sender, receiver = transports[0], transports[1]
    inbox = Inbox()
    receiver.subscribe(topic, inbox)
    sender.wait_for_peers(topic, 1)
    payload = bytes(range(256))
    sender.publish(topic, payload)
    assert inbox.get() == (sender.identity, payload)
    assert sender.sent.messages == 1
    assert payload_len_plus_envelope(sender.sent.bytes, len(payload))


def payload_len_plus_envelope(sent: int, payload: int) -> bool:
    return payload < sent < payload + 64


def test_every_subscriber_receives_but_not_the_publisher(transports, topic):
    inboxes = [Inbox() for _ in transports]
    for transport, inbox in zip(transports, inboxes, strict=True):
        transport.subscribe(topic, inbox)
    transports[0].wait_for_peers(topic, 2)
    transports[0].publish(topic, b"hello")
    assert inboxes[1].get() == (transports[0].identity, b"hello")
    assert inboxes[2].get() == (transports[0].identity, b"hello")
    assert inboxes[0].empty_after(0.5)  # Kubo echoes our own messages; the transport drops them


def test_deliver_own_hands_back_our_own_messages(kubo_nodes, topic):
    transport = IpfsTransport(kubo_nodes[0].api, deliver_own=True)
    try:
        inbox = Inbox()
        transport.subscribe(topic, inbox)
        transport.publish(topic, b"echo")
        assert inbox.get() == (transport.identity, b"echo")
    finally:
        transport.close()


def test_10_mb_payload_arrives_intact_via_blocks(transports, topic):
    sender, receiver = transports[0], transports[2]
    inbox = Inbox()
    receiver.subscribe(topic, inbox)
    sender.wait_for_peers(topic, 1)
    payload = os.urandom(10_000_000)
    sender.publish(topic, payload)
    got_sender, got = inbox.get(timeout=60)
    assert got_sender == sender.identity
    assert len(got) == len(payload) and got == payload
    assert sender.sent.messages == 1
    assert len(payload) < sender.sent.bytes < len(payload) + 4096  # blocks + small envelope


def test_identical_payloads_both_arrive(transports, topic):
    sender, receiver = transports[0], transports[1]
    inbox = Inbox()
    receiver.subscribe(topic, inbox)
    sender.wait_for_peers(topic, 1)
    # One at a time: the second copy is published once the first arrived, so what is checked
    # is that the receiver does not take it for a duplicate (PubSub itself may drop a message
    # of a burst on a loaded machine, which the client's resends are there for).
    for payload in (b"same", b"same", b"x" * (INLINE_MAX + 1), b"x" * (INLINE_MAX + 1)):
        sender.publish(topic, payload)
        assert inbox.get() == (sender.identity, payload)


def test_garbage_on_the_topic_does_not_kill_the_subscriber(transports, topic):
    sender, receiver = transports[0], transports[1]
    inbox = Inbox()
    receiver.subscribe(topic, inbox)
    sender.wait_for_peers(topic, 1)
    for garbage in (b"\xc1 not msgpack", b"\x93\x01\x02\x03", b"\x81\xa1v\x01", os.urandom(64)):
        sender.kubo.pubsub_pub(topic, garbage)
    # a block list whose sizes lie about the total
    sender.kubo.pubsub_pub(topic, b"\x84\xa1v\x01\xa1n\xc4\x00\xa1b\x91\x92\xa3cid\x05\xa1t\x06")
    sender.publish(topic, b"still alive")
    assert inbox.get() == (sender.identity, b"still alive")


def test_publish_after_close_raises(transports, topic):
    transports[0].close()
    with pytest.raises(RuntimeError, match="closed"):
        transports[0].publish(topic, b"late")


def test_blocks_nobody_has_do_not_stall_the_topic(kubo_nodes, topic, caplog):
    """Envelopes naming CIDs no peer holds are fetched off the reader thread: messages after
    them arrive at once, and one peer gets only PENDING_PER_PEER fetches in flight."""
    sender = IpfsTransport(kubo_nodes[0].api)
    receiver = IpfsTransport(kubo_nodes[1].api, fetch_timeout=60)
    try:
        inbox = Inbox()
        receiver.subscribe(topic, inbox)
        sender.wait_for_peers(topic, 1)
        gone = sender.kubo.block_put(os.urandom(64))
        sender.kubo.block_rm([gone])
        deadline = time.monotonic() + 30  # half the fetch timeout each bogus block gets
        for _ in range(PENDING_PER_PEER):
            sender.kubo.pubsub_pub(topic, pack_blocks([(gone, 64)], 64))
        # More, till the receiver refuses one: on a loaded machine PubSub lost more than
        # four in a row.
        while "being fetched already" not in caplog.text:
            assert time.monotonic() < deadline, "fetches in flight had no limit"
            sender.kubo.pubsub_pub(topic, pack_blocks([(gone, 64)], 64))
            time.sleep(0.05)
        while True:
            sender.publish(topic, b"after the bogus ones")  # again, if PubSub lost it
            try:
                assert inbox.get(timeout=2) == (sender.identity, b"after the bogus ones")
                break
            except queue.Empty:
                assert time.monotonic() < deadline, "the topic stalled behind bogus blocks"
    finally:
        sender.close()
        receiver.close()


def test_eight_nodes_naming_missing_blocks_leave_assemblers_and_memory_for_another(
    kubo_nodes, topic, caplog
):
    """Measured on main: 8 peer IDs x 4 envelopes naming missing blocks took all 32
    assemblers, and a victim's 1 MiB payload was dropped until their fetches timed out.
    Here the 8 nodes' envelopes come to the reader as if each from a node of its own; the
    victim's payload arrives while they wait, and what the fetches would hold stays within
    each node's share of the budget (one envelope declaring more is dropped)."""
    sender = IpfsTransport(kubo_nodes[0].api)
    cap = 64 << 20  # shares of 4 MiB
    receiver = IpfsTransport(kubo_nodes[1].api, fetch_timeout=20, budget=MemoryBudget(cap))
    try:
        inbox = Inbox()
        receiver.subscribe(topic, inbox)
        sender.wait_for_peers(topic, 1)
        gone = [sender.kubo.block_put(os.urandom(1 << 19)) for _ in range(2)]
        sender.kubo.block_rm(gone)
        sybils = [f"12D3KooWsybil{i}" for i in range(8)]
        for sybil in sybils:  # (as the reader thread hears them)
            receiver._receive(topic, sybil, pack_blocks([(c, 1 << 19) for c in gone], 1 << 20))
        for _ in range(PENDING_PER_PEER):
            for sybil in sybils:
                receiver._receive(topic, sybil, pack_blocks([(gone[0], 1 << 19)] * 16, 8 << 20))
                receiver._receive(topic, sybil, pack_blocks([(c, 1 << 19) for c in gone], 1 << 20))
        assert "past its share of this worker's memory, 4.0 MiB" in caplog.text
        held = {s: receiver._pending.get(s, 0) for s in sybils}
        assert sum(held.values()) < ASSEMBLERS and max(held.values()) <= PENDING_PER_PEER
        assert receiver.budget.held() == sum(held.values()) << 20 <= cap
        payload = os.urandom(1 << 20)
        deadline = time.monotonic() + 10  # the sybils' fetches wait 20 s
        while True:
            sender.publish(topic, payload)  # again, if PubSub lost it
            try:
                assert inbox.get(timeout=2) == (sender.identity, payload)
                break
            except queue.Empty:
                assert time.monotonic() < deadline, "the victim found no assembler free"
    finally:
        sender.close()
        receiver.close()


def test_a_sealed_payload_leaves_no_block_in_either_repo(kubo_nodes):
    """GridTransport: the receiver removes its fetched copies and acknowledges; the sender
    then removes its own."""
    sender, receiver = (GridTransport(node.api) for node in kubo_nodes[:2])
    try:
        directory = Directory()
        sender.directory = directory
        directory.on_message(receiver.identity, wire.encode(
            {"kind": "announce", "name": "wt", "instance": "i", "lease": 300}))  # fmt: skip
        inbox = Inbox()
        receiver.subscribe(worker_topic("wt"), inbox)
        sender.wait_for_peers(worker_topic("wt"), 1)
        receiver.wait_for_peers(ACK_PREFIX + sender.identity, 1)  # the ack reaches it
        before = [set(Kubo(n.api).refs_local()) for n in kubo_nodes[:2]]
        payload = os.urandom(3 * INLINE_MAX)
        sender.publish(worker_topic("wt"), payload)
        assert inbox.get() == (sender.identity, payload)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            left = [set(Kubo(n.api).refs_local()) - b for n, b in zip(kubo_nodes, before)]
            if not any(left):
                break
            time.sleep(0.1)
        assert left == [set(), set()]
    finally:
        sender.close()
        receiver.close()
