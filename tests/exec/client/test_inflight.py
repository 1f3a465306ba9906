"""Asynchronous dispatch (exec/client/inflight.py): runs sent without waiting, settled at
sync points, in order on each worker whatever the transport does, bounded in flight.

Every run was synchronous: `Client._run_plan` waited for every reply, so a training loop
paid the full latency of every step even when nobody read the loss (on Kubo, 60 compiled
steps without a sync cost 1.03-1.68x the synchronous step: no overlap at all).
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gridgraph as gg
from gridgraph.exec.client.client import Client
from gridgraph.exec.grid import Grid
from gridgraph.exec.safety.limits import Limits
from gridgraph.exec.worker.worker import Worker
from tests.exec.chaos import ChaosBus
from tests.exec.test_resend import DeafBus


def chaos_grid(bus: ChaosBus, n: int = 2) -> Grid:
    names = [f"w{i}" for i in range(n)]
    workers = [Worker(name, bus.endpoint(name), limits=Limits.unlimited()) for name in names]
    client = Client(bus.endpoint("client"), names, retry_after=0.05)

    def stop() -> None:
        for w in workers:
            w.close()
        bus.close()

    return Grid(client, on_close=stop, local_workers=workers)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 1))


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 6, generator=g), torch.randn(4, 1, generator=g)) for _ in range(n)]


def train_on_grid(grid: Grid, steps: int, sync_every_step: bool) -> list[torch.Tensor]:
    """The MLP trained with a compiled step, its layers on two workers; its parameters."""
    model = mlp()
    model[0].send(grid.workers[0])
    model[2].send(grid.workers[1])
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    @gg.compile
    def step(x, y):
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss

    for x, y in batches(steps):
        loss = step(x, y)
        if sync_every_step:
            loss.item()
    assert step.replays > 0
    return [p.get() for p in model.parameters()]


def train_in_torch(steps: int) -> list[torch.Tensor]:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for x, y in batches(steps):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


def test_async_and_sync_steps_give_bit_identical_parameters():
    with gg.local_grid(2) as grid:
        synced = train_on_grid(grid, 12, sync_every_step=True)
    with gg.local_grid(2) as grid:
        unsynced = train_on_grid(grid, 12, sync_every_step=False)
    expected = train_in_torch(12)
    for a, b, c in zip(synced, unsynced, expected):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_unsynced_steps_run_in_order_over_loss_duplication_and_reorder():
    bus = ChaosBus(3, lose=0.05, duplicate=0.1, delay=0.01)
    with chaos_grid(bus) as grid:
        got = train_on_grid(grid, 20, sync_every_step=False)
    assert bus.lost > 0 and bus.duplicated > 0 and bus.delayed > 0
    for a, b in zip(got, train_in_torch(20)):
        assert torch.equal(a, b)


def test_in_place_runs_run_in_the_order_issued_over_reorder():
    bus = ChaosBus(5, duplicate=0.2, delay=0.02)
    with chaos_grid(bus, 1) as grid:
        x = torch.ones(3).send(grid.workers[0])
        expected = torch.ones(3)
        for i in range(40):  # a run each, not waited for
            with gg.trace():
                if i % 2:
                    x.mul_(2.0)
                else:
                    x.add_(1.0)
            x.compute()
            if i % 2:
                expected.mul_(2.0)
            else:
                expected.add_(1.0)
        assert len(grid.client.in_flight.runs) > 1  # they went without waiting
        assert torch.equal(x.get(), expected)


def test_compute_returns_once_sent_and_a_failure_is_raised_at_the_next_sync():
    with gg.local_grid(1) as grid:
        a = torch.ones(3).send(grid.workers[0])
        i = torch.tensor([5]).send(grid.workers[0])
        with gg.trace():
            bad = a.index_select(0, i)  # the line the error names
            fine = a * 2
        bad.compute()  # returns: nothing has answered yet
        fine.compute()
        try:
            grid.sync()
        except gg.RemoteError as e:
            assert "test_inflight.py" in e.where and e.op.startswith("aten::index_select")
        else:
            raise AssertionError("grid.sync() did not raise the failure of an earlier run")
        assert torch.equal(fine.get(), torch.full((3,), 2.0))  # raised once; others stand
        try:
            bad.get()
        except gg.RemoteError as e:
            assert "index" in str(e)
        else:
            raise AssertionError("a value of the failed run read as if it were computed")


def test_a_failure_nobody_synced_is_raised_at_the_end_of_the_with_block():
    raised = None
    try:
        with gg.local_grid(1) as grid:
            a, i = torch.ones(3).send(grid.workers[0]), torch.tensor([9]).send(grid.workers[0])
            with gg.trace():
                bad = a.index_select(0, i)
            bad.compute()  # returns once sent
    except gg.RemoteError as e:
        raised = e
    assert raised is not None and "test_inflight.py" in raised.where
    assert grid.client.closed


def test_back_pressure_bounds_what_ten_thousand_unsynced_steps_hold():
    with gg.local_grid(2) as grid:
        grid.max_in_flight = 4
        w = torch.zeros(4, 1).send(grid.workers[0])
        x = torch.randn(8, 4).send(grid.workers[1])
        step = gg.compile(lambda w: w - 0.001 * (x.T @ (x @ w)))
        client = grid.client
        sessions = [next(iter(worker.sessions.values())) for worker in grid.local_workers]
        peak_runs = peak_outstanding = peak_records = peak_memory = 0
        for i in range(10_000):
            w = step(w)
            if i % 100 == 0:
                peak_runs = max(peak_runs, max(client.in_flight.per_worker.values()))
                peak_outstanding = max(peak_outstanding, len(client.requests._outstanding))
                peak_records = max(peak_records, *(len(s.records) for s in sessions))
                peak_memory = max(peak_memory, *(s.memory() for s in sessions))
        assert peak_runs <= 4 and peak_outstanding <= 2 * 4
        assert peak_records < 100 and peak_memory < 200_000  # not growing with the steps
        expected = torch.zeros(4, 1)
        X = x.get()
        for _ in range(10_000):
            expected = expected - 0.001 * (X.T @ (X @ expected))
        assert torch.allclose(w.get(), expected, atol=1e-6)


def interrupt_after(seconds: float) -> threading.Timer:
    """Ctrl-C (SIGINT to this process) after `seconds`: KeyboardInterrupt in the main
    thread, where the test waits."""
    timer = threading.Timer(seconds, lambda: os.kill(os.getpid(), signal.SIGINT))
    timer.start()
    return timer


def long_program(grid: Grid, ops: int = 4000) -> gg.RemoteTensor:
    """A pointer whose one run takes seconds: `ops` matmuls on w0."""
    x = torch.eye(192).send(grid.workers[0])
    with gg.trace():
        y = x
        for _ in range(ops):
            y = y @ x
    return y


def grid_running_a_long_program(isolate: bool) -> tuple[Grid, gg.RemoteTensor]:
    """A one-worker grid running `long_program`, and the pointer it computes. `isolate`: its
    programs run in an executor process (started and warm: under load its start takes
    seconds, and its warm-up runs one op)."""
    grid = gg.local_grid(1, isolate=isolate)
    if isolate:
        warm = torch.ones(2).send(grid.workers[0])
        assert torch.equal((warm + 1).get(), torch.full((2,), 2.0))  # the executor serves
    return grid, long_program(grid).compute()  # returns at once


@pytest.mark.parametrize("isolate", [False, True], ids=["in-process", "executor"])
def test_ctrl_c_during_a_wait_cancels_the_runs_and_close_takes_under_two_seconds(isolate):
    # Ctrl-C raised, but leaving the `with` block blocked ~23 s until the worker had run the
    # whole program, and the session stayed on the worker until its lease ended. With
    # isolation (every `gridgraph worker`), the abort reached only the network process's
    # copy of the session: the program ran on to its end in its executor.
    grid, y = grid_running_a_long_program(isolate)
    timer = interrupt_after(0.5)
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        y.get()
    timer.join()
    interrupted = time.monotonic()
    assert interrupted - start < 1.5  # returned at once (one Ctrl-C)
    with pytest.raises(gg.GridError, match="cancelled"):
        y.get()
    ops = grid.stats()["workers"]["w0"]["ops_run"]  # (counted in the executor, if any)
    assert ops < 4000 + isolate  # it stopped between ops (or before the first)
    grid.close()
    assert time.monotonic() - interrupted < 2.0
    assert not grid.local_workers[0].sessions  # everything it held is freed


def test_ctrl_c_during_sync_cancels_every_run_in_flight():
    grid = gg.local_grid(1)
    x = torch.eye(192).send(grid.workers[0])

    def chain(y):
        for _ in range(300):
            y = y @ x
        return y

    step, y = gg.compile(chain), x
    for _ in range(10):
        y = step(y)
    assert grid.client.in_flight.runs  # still in flight
    timer = interrupt_after(0.3)
    with pytest.raises(KeyboardInterrupt):
        grid.sync()
    timer.join()
    assert not grid.client.in_flight.runs
    start = time.monotonic()
    grid.close()
    assert time.monotonic() - start < 2.0
    assert not grid.local_workers[0].sessions


def test_grid_cancel_from_another_thread_ends_the_wait_with_the_runs_cancelled():
    with gg.local_grid(1) as grid:
        y = long_program(grid).compute()
        threading.Timer(0.5, grid.cancel).start()
        start = time.monotonic()
        with pytest.raises(gg.RemoteError, match="cancelled"):
            grid.sync()
        assert time.monotonic() - start < 1.5
        x = torch.ones(2).send(grid.workers[0])
        assert torch.equal((x * 2).get(), torch.full((2,), 2.0))  # later runs run
        with pytest.raises(gg.RemoteError, match="cancelled"):
            y.get()


def test_grid_cancel_stops_a_program_running_in_an_executor_process():
    grid, y = grid_running_a_long_program(isolate=True)
    with grid:
        threading.Timer(0.5, grid.cancel).start()
        start = time.monotonic()
        with pytest.raises(gg.RemoteError, match="cancelled by its client"):
            grid.sync()
        assert time.monotonic() - start < 2.0
        assert grid.stats()["workers"]["w0"]["ops_run"] < 4001
        x = torch.ones(2).send(grid.workers[0])
        assert torch.equal((x * 2).get(), torch.full((2,), 2.0))  # later runs run


def test_a_run_nobody_answers_times_out_at_the_sync_once():
    bus = DeafBus()
    worker = Worker("w0", bus.endpoint("w0"), limits=Limits.unlimited())
    client = Client(bus.endpoint("client"), ["w0"], timeout=0.3, retry_after=0.05)
    with Grid(client, on_close=worker.close, local_workers=[worker]) as grid:
        x = torch.ones(2).send(grid.workers[0])
        with gg.trace():
            y = x * 2
        bus.deaf = True
        y.compute()  # sent, and lost with every resend
        with pytest.raises(gg.GridError, match="did not answer"):
            grid.sync()
        assert not grid.client.in_flight.runs
        bus.deaf = False
        grid.sync()  # raised once
        with pytest.raises(gg.GridError, match="did not answer"):
            y.get()  # its value is a failed one
        assert torch.equal((x * 3).get(), torch.full((2,), 3.0))
