"""Replies kept until acknowledged (exec/client/requests.py and worker/session.py), over a bus
that loses, duplicates and reorders messages.

A worker kept the 16 latest replies of a session: with more requests in flight, one reply
that PubSub dropped turned a request that ran into `RemoteError: request already served;
its reply is no longer kept` (8 clients x 100 concurrent computations on 3 Kubo workers:
27-37% of them failed so). Now each request says which replies its client no longer needs,
and a worker keeps every other one.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from gridgraph.errors import WorkerLost
from gridgraph.exec.client.requests import Requests
from gridgraph.exec.protocol import ALREADY_SERVED, client_topic
from gridgraph.exec.safety.limits import Limits
from gridgraph.exec.transport import LocalBus, NotSent
from gridgraph.exec.worker.worker import Worker
from tests.exec import hostile
from tests.exec.chaos import ChaosBus
from tests.exec.local_peer import add_one_in_place

FETCH_1 = {"kind": "run", "run": 2, "plan": 2, "program": [[["return", 0]]], "slots": [1],
           "params": []}  # fmt: skip


@pytest.fixture
def chaos():
    """A bus that loses 15% of messages, duplicates 10% and reorders every kind of message,
    with one worker on it; and a `Requests` of a client there that asks again soon."""
    bus = ChaosBus(7, lose=0.15, duplicate=0.1, delay=0.02)
    bus.which = lambda kind: True
    worker = Worker("w0", bus.endpoint("w0"), limits=Limits.unlimited())
    transport = bus.endpoint("client")
    requests = Requests(transport, client_topic("client", "s1"), "s1", ["w0"],
                        retry_after=0.05, timeout=60, on_lost=lambda w: [])  # fmt: skip
    yield bus, requests, worker
    worker.close()
    bus.close()


def lossy_only_for_replies(bus: ChaosBus) -> None:
    """Requests and transfers go through intact (at once): only replies are lost."""
    bus.which = lambda kind: kind == "reply"


def test_a_hundred_requests_in_flight_with_lost_replies_each_run_once_none_refused(chaos):
    bus, requests, worker = chaos
    assert requests.call("w0", {"kind": "put", "values": [[1, torch.zeros(1)]]})["ok"]
    with ThreadPoolExecutor(100) as pool:
        replies = list(pool.map(lambda _: requests.call("w0", add_one_in_place(1)), range(100)))
    assert all(r["ok"] for r in replies)  # none "already served; reply no longer kept"
    [[_, value]] = requests.call("w0", FETCH_1)["returns"]
    assert torch.equal(value, torch.full((1,), 100.0))  # each ran exactly once
    assert bus.lost > 10 and bus.duplicated > 10 and bus.delayed > 100


def test_replies_are_let_go_once_acknowledged(chaos):
    bus, requests, worker = chaos
    bus.chaos = False
    for _ in range(50):
        assert requests.call("w0", {"kind": "ping"})["ok"]
    state = next(iter(worker.sessions.values()))
    # Each request acknowledged every earlier one: only the latest reply is kept.
    assert [rec.reply is not None for rec in state.records.values()] == [True]
    assert state.acked_below == 50


def test_requests_still_out_hold_the_watermark_and_the_rest_are_acknowledged_by_id(chaos):
    bus, requests, worker = chaos
    lossy_only_for_replies(bus)
    bus.lose = 1.0  # replies to these never come: their waits are still on
    waiting = [requests.send("w0", {"kind": "ping"}) for _ in range(3)]
    bus.lose = 0.0
    assert requests.call("w0", {"kind": "ping"})["ok"]
    assert requests.call("w0", {"kind": "ping"})["ok"]
    state = next(iter(worker.sessions.values()))
    assert state.acked_below == int(waiting[0], 16)
    assert state.records[waiting[0]].reply is not None  # still needed: kept
    assert state.records["4"].reply is None  # acknowledged by id, above the watermark
    assert requests.wait_all({"w0": waiting[0]})["w0"]["ok"]  # a resend, answered again


def test_only_an_acknowledged_request_is_refused_as_already_served(local_grid):
    peer = hostile.Peer(local_grid.client.transport._bus.endpoint("p"))
    assert peer.request("w0", {"kind": "put", "values": [[1, torch.zeros(1)]]}, rid="1")["ok"]
    for n in range(2, 42):  # 40 runs, no acknowledgement: each reply is kept
        assert peer.request("w0", add_one_in_place(1), rid=f"{n:x}")["ok"]
    again = peer.request("w0", add_one_in_place(1), rid="2")  # its reply was lost: resent
    assert again["ok"] and again["re"] == "2"
    ack = {"below": 30, "ids": [35]}
    assert peer.request("w0", {"kind": "ping", "ack": ack}, rid="2a")["ok"]
    for rid in ("2", "23"):  # "2": under the watermark; "35": acknowledged by id
        refused = peer.request("w0", add_one_in_place(1), rid=rid)
        assert refused["error"]["code"] == ALREADY_SERVED
        assert "acknowledged" in refused["error"]["message"]
    assert peer.request("w0", add_one_in_place(1), rid="1e")["ok"]  # 30: not acknowledged
    [[_, value]] = peer.request("w0", {**FETCH_1, "ack": ack}, rid="2b")["returns"]
    assert torch.equal(value, torch.full((1,), 40.0))  # none ran twice


def test_an_old_copy_under_the_watermark_never_runs(local_grid):
    # A copy the transport delivers late, after its client acknowledged the request (or
    # gave up on it): no record of it is kept, and it must not run as a new request.
    peer = hostile.Peer(local_grid.client.transport._bus.endpoint("p"))
    assert peer.request("w0", {"kind": "put", "values": [[1, torch.zeros(1)]]}, rid="1")["ok"]
    assert peer.request("w0", {"kind": "ping", "ack": {"below": 9, "ids": []}}, rid="9")["ok"]
    late = peer.request("w0", add_one_in_place(1), rid="5")  # never seen before
    assert late["error"]["code"] == ALREADY_SERVED
    [[_, value]] = peer.request("w0", FETCH_1, rid="a")["returns"]
    assert torch.equal(value, torch.zeros(1))


def test_frees_sent_on_their_own_are_acknowledged_once_their_reply_came(chaos):
    bus, requests, worker = chaos
    bus.chaos = False
    requests.free({"w0": list(range(1000, 1600))})  # over FREE_BATCH: a batch of its own
    deadline = time.monotonic() + 5
    while requests._free_batches and time.monotonic() < deadline:
        time.sleep(0.01)
    assert requests.call("w0", {"kind": "ping"})["ok"]
    state = next(iter(worker.sessions.values()))
    assert state.acked_below == 2  # the batch's reply came: acknowledged


def test_a_wait_given_up_acknowledges_its_request(chaos):
    bus, requests, worker = chaos
    lossy_only_for_replies(bus)
    bus.lose = 1.0
    requests.timeout = 0.2
    rid = requests.send("w0", {"kind": "ping"})
    with pytest.raises(Exception, match="did not answer"):
        requests.wait_all({"w0": rid})
    bus.lose = 0.0
    requests.timeout = 60
    assert requests.call("w0", {"kind": "ping"})["ok"]
    state = next(iter(worker.sessions.values()))
    assert state.acked_below == 2 and "1" not in state.records


class RefusingBus(LocalBus):
    """Refuses (NotSent) the first `refusals` publishes to a worker, as Kubo refuses a
    publish it is still validating another through the same node."""

    def __init__(self, refusals: int) -> None:
        super().__init__()
        self.refusals = refusals

    def _deliver(self, sender: str, topic: str, payload: bytes, to: str | None) -> None:
        if self.refusals and topic.startswith("gridgraph.worker."):
            self.refusals -= 1
            raise NotSent("HTTP 500 validation ignored")
        super()._deliver(sender, topic, payload, to)


def test_a_publish_refused_for_now_is_sent_again_never_raised():
    bus = RefusingBus(refusals=3)
    worker = Worker("w0", bus.endpoint("w0"), limits=Limits.unlimited())
    requests = Requests(bus.endpoint("client"), client_topic("client", "s1"), "s1", ["w0"],
                        retry_after=0.05, on_lost=lambda w: [])  # fmt: skip
    try:
        assert requests.call("w0", {"kind": "put", "values": [[1, torch.zeros(1)]]})["ok"]
        assert requests.call("w0", add_one_in_place(1))["ok"]
        [[_, value]] = requests.call("w0", FETCH_1)["returns"]
        assert torch.equal(value, torch.ones(1)) and bus.refusals == 0
    finally:
        worker.close()


def test_a_worker_that_replies_is_alive_whatever_its_heartbeats():
    # 8 clients x 100 computations on 3 Kubo workers: 108 WorkerLost for live workers, whose
    # announcements were lost with the rest under load while their replies came.
    bus = LocalBus()
    worker = Worker("w0", bus.endpoint("w0"), limits=Limits.unlimited())
    heartbeats = [True]

    def requests_of(name: str, on: LocalBus = bus) -> Requests:
        return Requests(on.endpoint(name), client_topic(name, "s1"), "s1", ["w0"],
                        alive=lambda w: heartbeats[0], on_lost=lambda w: [])  # fmt: skip

    try:
        requests = requests_of("client")
        assert requests.call("w0", {"kind": "ping"})["ok"]
        heartbeats[0] = False  # none heard for a while: `alive` says it is gone
        with ThreadPoolExecutor(50) as pool:
            replies = list(pool.map(lambda _: requests.call("w0", {"kind": "ping"}), range(50)))
        assert all(r["ok"] for r in replies)
        with pytest.raises(WorkerLost):  # one it never answered (gone) is lost at once
            requests_of("other", LocalBus()).call("w0", {"kind": "ping"})
    finally:
        worker.close()
