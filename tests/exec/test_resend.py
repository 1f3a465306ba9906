"""Asking again for what a lossy transport dropped, after waits learned per replayed step
(gridgraph/exec/resend.py).

The end-to-end tests drop one message of a replayed step on a local bus and make the fixed
waits a minute long: the step still ends within seconds, with plain torch's values, only if
the client (a lost run message) or the receiving worker (a lost transfer) asked again after
the wait its earlier runs taught it. A batch of frees, sent unawaited, is not asked again:
its ids go with the next request to its worker once it is refused or long unanswered.

Why learned waits: Kubo drops 0.5-3% of PubSub messages. A replayed multinode step of 13 ms
has about ten messages, so about one step in twelve lost one, and with a fixed wait of 0.5 s
the mean step was four times the median.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

import gridgraph as gg
from gridgraph.errors import GridError
from gridgraph.exec import wire
from gridgraph.exec.client.client import Client
from gridgraph.exec.client.requests import FREE_BATCH
from gridgraph.exec.grid import Grid
from gridgraph.exec.resend import FLOOR, KEYS_KEPT, AnswerTimes
from gridgraph.exec.safety.limits import Limits
from gridgraph.exec.transport import LocalBus
from gridgraph.exec.worker import run, session
from gridgraph.exec.worker import worker as worker_module
from gridgraph.exec.worker.worker import Worker

LONG = 60.0  # the fixed waits, in seconds: far longer than any test waits for a step


def test_a_key_never_answered_waits_the_default():
    assert AnswerTimes().wait("step", 0.5) == 0.5


def test_waits_follow_the_answer_times_between_the_floor_and_the_default():
    times = AnswerTimes()
    for _ in range(30):
        times.observe("steady", 0.01)
        times.observe("instant", 1e-5)
        times.observe("slow", 2.0)
    assert 0.02 <= times.wait("steady", 0.5) < 0.03  # twice the time, the deviation gone
    assert times.wait("instant", 0.5) == FLOOR
    assert times.wait("slow", 0.5) == 0.5  # never later than without learning


def test_a_step_that_got_slower_is_learned_not_resent_every_time():
    times = AnswerTimes()
    for _ in range(30):
        times.observe("step", 0.01)
    for _ in range(30):
        times.observe("step", 0.1)
    assert times.wait("step", 10.0) > 0.15


def test_answer_times_are_kept_for_a_bounded_number_of_keys():
    times = AnswerTimes()
    for key in range(KEYS_KEPT + 1):
        times.observe(key, 0.01)
    assert times.wait(0, 0.5) == 0.5  # the least recently used went
    assert times.wait(KEYS_KEPT, 0.5) < 0.5


class LossyBus(LocalBus):
    """A local bus that drops the first message of `kind` published once `armed` is set."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind, self.armed, self.dropped = kind, False, 0

    def _deliver(self, sender: str, topic: str, payload: bytes, to: str | None) -> None:
        if self.armed and not self.dropped and wire.decode(payload).get("kind") == self.kind:
            self.dropped += 1
            return
        super()._deliver(sender, topic, payload, to)


def lossy_grid(bus: LossyBus) -> Grid:
    names = ["w0", "w1"]
    workers = [Worker(name, bus.endpoint(name), limits=Limits.unlimited()) for name in names]
    client = Client(bus.endpoint("client"), names, retry_after=LONG)

    def stop_workers() -> None:
        for w in workers:
            w.close()

    return Grid(client, on_close=stop_workers, local_workers=workers)


def losing_one(bus: LossyBus, once: Callable[[], Any], times: int = 8, warm_up: int = 5) -> list:
    """What `once()` returns, called `times` times on a thread of its own, with the bus armed
    from call `warm_up` on. Fails unless they all end within 30 s (a fixed wait is LONG)."""
    got, finished = [], threading.Event()

    def run() -> None:
        for i in range(times):
            bus.armed = bus.armed or i == warm_up
            got.append(once())
        finished.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(30)
    assert finished.is_set(), f"a lost {bus.kind} waited for the fixed {LONG} s"
    return got


def train(grid: Grid, bus: LossyBus, steps: int = 8, warm_up: int = 5) -> torch.Tensor:
    """Least squares by gradient descent, the data on w1 and the weights on w0, so that every
    step has transfers both ways; drops a message from the step after `warm_up` on.
    Returns the weights, checked against plain torch."""
    torch.manual_seed(0)
    X, Y = torch.randn(16, 3), torch.randn(16, 1)
    x, y = X.send(grid.workers[1]), Y.send(grid.workers[1])

    def step(w):
        with gg.on(grid.workers[1]):
            g = x.T @ (x @ w - y)
        with gg.on(grid.workers[0]):
            return w - 0.01 * g

    compiled = gg.compile(step)
    w = torch.zeros(3, 1).send(grid.workers[0])
    expected = torch.zeros(3, 1)

    def one_step() -> None:
        nonlocal w
        w = compiled(w)
        grid.sync()  # (a step returns once sent: each is waited for here)

    losing_one(bus, one_step, steps, warm_up)
    assert bus.dropped == 1 and compiled.replays > 0
    for _ in range(steps):
        expected = expected - 0.01 * (X.T @ (X @ expected - Y))
    torch.testing.assert_close(w.get(), expected)
    return w


def test_a_replayed_step_whose_run_message_was_lost_is_resent_after_its_learned_wait():
    bus = LossyBus("run")
    with lossy_grid(bus) as grid:
        train(grid, bus)


def test_a_replayed_step_whose_transfer_was_lost_asks_for_it_after_its_learned_wait(
    monkeypatch,
):
    # (in-process: an executor, forked from a forkserver started before the patch, would
    # keep the default of 0.5 s; its recv frame carries the learned wait, see test_executor)
    monkeypatch.setattr(run, "RESEND_AFTER", LONG)
    monkeypatch.setattr(worker_module, "RESEND_AFTER", LONG)
    bus = LossyBus("transfer")
    with lossy_grid(bus) as grid:
        train(grid, bus)


def test_a_lost_batch_sent_each_step_is_sent_again_after_the_learned_wait():
    # A training loop sends each step's batch (a `put` request): its loss waited the fixed
    # retry_after too.
    bus = LossyBus("put")
    with lossy_grid(bus) as grid:
        batches = [torch.randn(8, 3) for _ in range(8)]
        unsent = iter(batches)
        got = losing_one(bus, lambda: next(unsent).send(grid.workers[1]))
        assert bus.dropped == 1
        for pointer, batch in zip(got, batches):
            assert torch.equal(pointer.get(), batch)


def test_a_data_dependent_op_whose_run_was_lost_is_resent_after_its_learned_wait():
    # An op whose result's shape depends on the data runs as a plan of its own, made anew
    # under a fresh id each time: its answer times were never learned, and a lost run
    # waited the fixed retry_after.
    bus = LossyBus("run")
    with lossy_grid(bus) as grid:
        a = torch.randn(64)
        x = a.send(grid.workers[0])
        mask = x > 0
        got = losing_one(bus, lambda: x[mask])
        assert bus.dropped == 1
        for pointer in got:
            assert torch.equal(pointer.get(), a[a > 0])
        assert len(grid.client._programs_sent["w0"]) < 8  # (each ran once; none is kept)


class SlowResendBus(LocalBus):
    """Drops the first ping to w0; its resend then takes until `go` is set (a publish that
    takes a while, as one on IPFS does), and says so in `resending`."""

    def __init__(self) -> None:
        super().__init__()
        self.lost: str | None = None  # the request id of the ping lost
        self.resending, self.go = threading.Event(), threading.Event()

    def _deliver(self, sender: str, topic: str, payload: bytes, to: str | None) -> None:
        msg = wire.decode(payload)
        if topic == worker_module.worker_topic("w0") and msg.get("kind") == "ping":
            if self.lost is None:
                self.lost = msg["id"]
                return
            if msg["id"] == self.lost:
                self.resending.set()
                self.go.wait(20)
        super()._deliver(sender, topic, payload, to)


def test_a_slow_resend_holds_up_no_other_request():
    # The client resent while holding the lock every reply is taken under: a resend that
    # took a while (a call to Kubo) held up every other thread's replies as long.
    bus = SlowResendBus()
    workers = [Worker(name, bus.endpoint(name), limits=Limits.unlimited()) for name in ("w0", "w1")]
    client = Client(bus.endpoint("client"), ["w0", "w1"], retry_after=0.1)
    with Grid(client, on_close=lambda: [w.close() for w in workers], local_workers=workers):
        first = threading.Thread(target=client.request, args=("w0", {"kind": "ping"}))
        first.start()
        assert bus.resending.wait(20)
        try:
            assert client.request("w1", {"kind": "ping"})["ok"]  # answered meanwhile
            assert first.is_alive()  # (its resend is still going out)
        finally:
            bus.go.set()
            first.join(20)
        assert not first.is_alive()


def _frees_dead_pointers(grid: Grid, x: gg.RemoteTensor) -> int:
    """Compute FREE_BATCH values from `x` on its worker and let their pointers die; the
    number of values the worker then holds for this client."""
    with gg.trace():
        ys = [x + i for i in range(FREE_BATCH)]
    gg.compute(*ys)
    grid.sync()
    held = len(_session_of(grid).work.store)
    del ys
    gc.collect()
    return held


def _session_of(grid: Grid) -> session.Session:
    (only,) = grid.local_workers[0].sessions.values()
    return only


def test_a_lost_batch_of_frees_goes_again_with_the_next_request():
    # A batch of frees goes out on its own and unawaited; lost, its values stayed on the
    # worker until the session ended, as much as a whole training run dropped.
    bus = LossyBus("free")
    worker = Worker("w0", bus.endpoint("w0"), limits=Limits.unlimited())
    client = Client(bus.endpoint("client"), ["w0"], retry_after=0.05)
    with Grid(client, on_close=worker.close, local_workers=[worker]) as grid:
        x = torch.ones(2).send(grid.workers[0])
        assert _frees_dead_pointers(grid, x) == FREE_BATCH + 1
        bus.armed = True
        z = x * 2  # (a request releases the values of pointers that died: their batch goes
        assert bus.dropped == 1  # out first, and is lost)
        assert len(_session_of(grid).work.store) == FREE_BATCH + 2
        time.sleep(0.1)  # (past retry_after: lost, not late)
        w = x * 3  # this request carries the batch's ids again
        assert len(_session_of(grid).work.store) == 3  # x, z and w
        assert torch.equal(z.get(), x.get() * 2) and torch.equal(w.get(), x.get() * 3)


class DeafBus(LocalBus):
    """A local bus that drops every request to a worker while `deaf` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.deaf = False

    def _deliver(self, sender: str, topic: str, payload: bytes, to: str | None) -> None:
        if not (self.deaf and topic.startswith("gridgraph.worker.")):
            super()._deliver(sender, topic, payload, to)


def test_the_frees_of_a_request_that_timed_out_go_again_with_the_next_request():
    # A request carries the releases of pointers that died; when it timed out unanswered
    # (GridError), they were dropped with it, and their values stayed on the worker until
    # the session ended.
    bus = DeafBus()
    worker = Worker("w0", bus.endpoint("w0"), limits=Limits.unlimited())
    client = Client(bus.endpoint("client"), ["w0"], timeout=0.3, retry_after=0.05)
    with Grid(client, on_close=worker.close, local_workers=[worker]) as grid:
        x = torch.ones(2).send(grid.workers[0])
        with gg.trace():
            ys = [x + i for i in range(10)]  # (fewer than a batch of frees of their own)
        gg.compute(*ys)
        del ys
        gc.collect()
        bus.deaf = True
        with pytest.raises(GridError, match="did not answer"):
            x * 2  # (its request carries the 10 releases, and is lost, resends and all)
        assert len(_session_of(grid).work.store) == 11
        bus.deaf = False
        w = x * 3  # this request carries them again
        assert len(_session_of(grid).work.store) == 2  # x and w
        assert torch.equal(w.get(), x.get() * 3)


class FreeCountingBus(LocalBus):
    """A local bus that notes how many ids each message that frees some carries."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[int] = []

    def _deliver(self, sender: str, topic: str, payload: bytes, to: str | None) -> None:
        msg = wire.decode(payload)
        if msg.get("free"):
            self.batches.append(len(msg["free"]))
        super()._deliver(sender, topic, payload, to)


def test_frees_for_a_session_its_worker_ended_are_not_sent_again():
    # Every error reply says "refused": the batches to a worker that had ended the session
    # (its lease ran out) were refiled for ever, each carrying all the earlier ones again.
    bus = FreeCountingBus()
    worker = Worker("w0", bus.endpoint("w0"), limits=Limits.unlimited())
    client = Client(bus.endpoint("client"), ["w0"], retry_after=0.05)
    with Grid(client, on_close=worker.close, local_workers=[worker]) as grid:
        x = torch.ones(2).send(grid.workers[0])
        with gg.trace():
            halves = [[x + i for i in range(FREE_BATCH)] for _ in range(2)]
        gg.compute(*halves[0], *halves[1])
        grid.sync()
        worker.expire_clients(0)  # the worker frees all of it, and the session ends
        for _ in range(2):
            halves.pop()
            gc.collect()
            with pytest.raises(gg.SessionLost):  # (the batch goes out first, is refused)
                x * 2
        assert bus.batches == [FREE_BATCH, FREE_BATCH]  # not 512, then 1024
        assert not grid.client.requests._free_batches


def test_frees_for_a_worker_that_looks_gone_wait_until_it_is_back():
    # Unanswered, each batch to a worker that had died was refiled into the next, which
    # carried all the earlier ones again; dropped, a worker that only missed heartbeats
    # (on IPFS) kept their values for good.
    bus, alive = FreeCountingBus(), [True]  # (no worker answers on this bus)
    client = Client(bus.endpoint("client"), ["w0"], retry_after=0.01, alive=lambda w: alive[0])
    client.requests.frees["w0"] = list(range(FREE_BATCH))
    client.requests.send("w0", {"kind": "free"}, awaited=False)
    time.sleep(0.05)  # (past retry_after: lost)
    alive[0] = False
    client.requests.frees["w0"] = list(range(FREE_BATCH, 2 * FREE_BATCH))
    client.requests.send("w0", {"kind": "free"}, awaited=False)
    assert bus.batches == [FREE_BATCH, FREE_BATCH]  # not 512, then 1024
    alive[0] = True  # heard again
    time.sleep(0.05)  # (both unanswered past retry_after)
    client.requests.send("w0", {"kind": "ping"}, awaited=False)
    assert bus.batches == [FREE_BATCH, FREE_BATCH, 2 * FREE_BATCH]  # (the ping takes them)


def test_a_refused_batch_of_frees_goes_again_with_the_next_request():
    # A worker refuses a request over its peer's rate, and frees nothing then: the ids of a
    # refused batch of frees were dropped by the client all the same.
    rate = Limits(requests_per_second=0.5, request_burst=2)  # (a request per 2 s past two)
    with gg.local_grid(1, limits=rate) as grid:
        x = torch.ones(2).send(grid.workers[0])  # the first request of the burst
        assert _frees_dead_pointers(grid, x) == FREE_BATCH + 1  # the second
        with pytest.raises(gg.RemoteError, match="rate"):  # (its batch was refused first)
            x * 2
        assert len(_session_of(grid).work.store) == FREE_BATCH + 1
        time.sleep(2.2)  # a request's worth of the rate again
        z = x * 2  # this request carries the batch's ids again
        assert len(_session_of(grid).work.store) == 2 and z.location == "w0"  # x and z
        time.sleep(2.2)  # (for the bye, at the end)

    # (an executor names the wait in its recv frame: a taken-over one may name any number)
    assert run.resend_wait(0.0) == FLOOR
    assert run.resend_wait(1e9) == run.RESEND_AFTER
