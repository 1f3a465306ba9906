"""The client runtime: round trips, stats, freeing, errors and bad input."""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Callable

import pytest
import torch

import gridgraph as gg
from gridgraph.exec import wire
from gridgraph.exec.client.client import Client
from gridgraph.exec.client.requests import FREE_BATCH
from gridgraph.exec.protocol import client_topic, worker_topic
from gridgraph.exec.transport import LocalBus
from tests.source_lines import line_of


def test_pointer_holds_metadata_only(grid):
    p = gg.send(torch.arange(6.0).reshape(2, 3), grid.workers[0])
    assert isinstance(p, torch.Tensor) and isinstance(p, gg.RemoteTensor)
    assert p.shape == (2, 3) and p.dtype == torch.float32 and p.location == "w0"
    assert "location='w0'" in repr(p) and "computed=True" in repr(p)
    assert "0." not in repr(p)  # never a fake value
    with gg.trace():
        q = p + 1
    assert "computed=False" in repr(q) and q.location is None
    q.compute()
    assert q.location == "w0" and "computed=True" in repr(q)


def test_eager_op_is_one_round_trip(grid):
    p = gg.send(torch.ones(3), grid.workers[1])
    grid.reset_stats()
    q = p * 3  # outside trace(): runs now
    assert q.location == "w1"
    assert grid.stats()["messages"] == 2  # the run message and its reply
    assert torch.equal(q.get(), torch.full((3,), 3.0))


def test_trace_defers_until_compute(grid):
    p = gg.send(torch.ones(3), grid.workers[0])
    grid.reset_stats()
    with gg.trace():
        q = (p + 1) * 2
        r = q.sum()
    assert grid.stats()["messages"] == 0
    gg.compute(q, r)
    assert grid.stats()["messages"] == 2
    assert q.location == r.location == "w0"
    assert r.get().item() == 12.0


def test_stats_shape(grid):
    p = gg.send(torch.ones(100), grid.workers[0])
    (p * 2).compute()
    s = grid.stats()
    assert s["messages"] > 0 and s["bytes"] > 400
    assert set(s["workers"]) == {"w0", "w1", "w2"}
    w0 = s["workers"]["w0"]
    assert w0["objects"] >= 1 and w0["stored_bytes"] >= 400 and w0["ops_run"] >= 1


def test_freed_pointer_frees_remote_tensor(grid):
    w = grid.workers[2]
    before = grid.stats()["workers"]["w2"]["objects"]
    ps = [gg.send(torch.ones(10), w) for _ in range(5)]
    assert grid.stats()["workers"]["w2"]["objects"] == before + 5
    del ps
    gc.collect()
    assert grid.stats()["workers"]["w2"]["objects"] == before


def test_releases_are_batched(local_grid):
    w = local_grid.workers[0]
    ps = [gg.send(torch.ones(2), w) for _ in range(20)]
    local_grid.reset_stats()
    del ps
    gc.collect()
    keep = gg.send(torch.ones(2), w)  # the frees ride along with this request
    assert local_grid.stats()["messages"] == 2
    assert local_grid.stats()["workers"]["w0"]["objects"] == 1
    del keep


def test_intermediates_are_freed_in_the_same_run(grid):
    x = gg.send(torch.randn(8, 8), grid.workers[0])
    w = gg.send(torch.randn(8, 8), grid.workers[1])
    before = sum(s["objects"] for s in grid.stats()["workers"].values())
    with gg.trace():
        y = torch.relu(x @ w).exp().sum()
    y.compute()
    after = sum(s["objects"] for s in grid.stats()["workers"].values())
    assert after == before + 1  # only y remains; the copy of w and the temporaries are gone


def test_remote_error_names_worker_op_and_user_line(grid):
    a = gg.send(torch.randn(3, 4), grid.workers[0])
    b = gg.send(torch.randn(3, 4), grid.workers[0])
    with gg.trace():
        c = a.exp() + b
        d = c.index_select(0, torch.tensor([10]))  # out of range: only the kernel can tell
    with pytest.raises(gg.RemoteError) as info:
        d.get()
    err = info.value
    assert err.worker == "w0"
    assert "index_select" in err.op
    assert err.where.endswith(f"test_client.py:{_line_of('d = c.index_select')}")
    assert "index" in err.remote_message and err.where in str(err)
    # the worker keeps serving
    assert torch.equal((a * 0).get(), torch.zeros(3, 4))


@pytest.mark.parametrize("traced", [True, False], ids=["traced", "eager"])
def test_a_call_that_runs_at_once_names_the_user_line_it_failed_at(local_grid, traced):
    # a call whose meta kernel refused runs at once, as one with data-dependent output;
    # its outputs have no values yet, and its error read "recorded at <unknown>"
    a = gg.send(torch.randn(2, 3), local_grid.workers[0])
    with pytest.raises(gg.RemoteError) as info:
        with gg.trace() if traced else contextlib.nullcontext():
            torch.mm(a, a)  # the shapes do not match: torch's meta kernel says so
    assert info.value.where.endswith(f"test_client.py:{_line_of('torch.mm(a, a)  # the')}")


def _line_of(text: str) -> int:
    return line_of(__file__, text)


def test_shape_errors_raise_at_record_time(grid):
    a = gg.send(torch.randn(3, 4), grid.workers[0])
    with pytest.raises(RuntimeError):
        with gg.trace():
            a @ a


def test_bad_input_is_refused_before_anything_is_sent(local_grid):
    w0 = local_grid.workers[0]
    local_grid.reset_stats()
    with pytest.raises(TypeError, match="expected a torch.Tensor"):
        gg.send([1, 2, 3], w0)
    with pytest.raises(gg.GridError, match="device meta"):
        gg.send(torch.empty(3, device="meta"), w0)
    with pytest.raises(gg.GridError, match="layout"):
        gg.send(torch.eye(3).to_sparse(), w0)
    with pytest.raises(TypeError, match="expected a worker"):
        gg.send(torch.ones(2), "w0")
    with pytest.raises(gg.GridError, match="device meta"):
        local_grid.send_many([torch.ones(2), torch.empty(2, device="meta")], w0)
    assert local_grid.stats()["messages"] == 0
    assert local_grid.stats()["workers"]["w0"]["objects"] == 0


def test_worker_of_another_grid_is_refused():
    with gg.local_grid(1) as a, gg.local_grid(1) as b:
        with pytest.raises(gg.GridError, match="another grid"):
            b.send(torch.ones(2), a.workers[0])
        pa = gg.send(torch.ones(2), a.workers[0])
        pb = gg.send(torch.ones(2), b.workers[0])
        with pytest.raises(gg.RecordError, match="two different grids"):
            pa + pb


def test_closed_grid_is_refused():
    grid = gg.local_grid(2)
    p = gg.send(torch.ones(2), grid.workers[0])
    grid.close()
    with pytest.raises(gg.GridError, match="closed"):
        gg.send(torch.ones(2), grid.workers[0])
    with pytest.raises(gg.GridError, match="closed"):
        p.get()
    with pytest.raises(gg.GridError, match="closed"):
        grid.stats()


def test_local_tensor_on_unsupported_device_in_op(grid):
    p = gg.send(torch.ones(3), grid.workers[0])
    with pytest.raises(gg.RecordError, match="device meta"):
        p + torch.ones(3, device="meta")


def test_move_goes_worker_to_worker(grid):
    p = gg.send(torch.arange(4.0), grid.workers[0])
    grid.reset_stats()
    p.move(grid.workers[2])
    assert p.location == "w2"
    # run messages to both workers, the transfer, two replies: nothing through the client
    assert grid.stats()["messages"] == 5
    assert torch.equal(p.get(), torch.arange(4.0))


def test_on_pins_ops_to_a_worker(grid):
    p = gg.send(torch.ones(4), grid.workers[0])
    with gg.trace(), gg.on(grid.workers[1]):
        q = p * 2
    q.compute()
    assert q.location == "w1"


def test_memory_cap_keeps_new_tensors_off_a_full_worker():
    with gg.local_grid(2, memory_cap=128 * 1024) as grid:
        w0, w1 = grid.workers
        a = gg.send(torch.randn(64, 64), w0)  # 16 KB
        b = gg.send(torch.randn(64, 64), w1)
        with gg.trace():
            big = [torch.cat([a, b]) for _ in range(5)]  # 32 KB each: 3 fit on one worker
        gg.compute(*big)
        assert {p.location for p in big} == {"w0", "w1"}
        torch.testing.assert_close(big[0].get(), torch.cat([a.get(), b.get()]))


def test_what_nobody_asked_for_is_not_computed(local_grid):
    p = gg.send(torch.ones(3), local_grid.workers[0])
    with gg.trace():
        wanted = p + 1
        unwanted = p * 100
    local_grid.reset_stats()
    wanted.compute()
    assert local_grid.stats()["workers"]["w0"]["ops_run"] == 1
    assert wanted.computed and not unwanted.computed


@pytest.mark.parametrize("traced", [True, False], ids=["traced", "eager"])
@pytest.mark.parametrize(
    "call, match",
    [
        (lambda p: p.chalf(), "dtype torch.complex32"),  # the wire carries no complex32
        (lambda p: p.to_sparse(), "only dense"),
        (lambda p: p.set_(torch.ones(3)), "not on the workers' op allowlist"),  # off the allowlist
    ],
    ids=["complex32", "sparse", "refused_op"],
)
def test_what_workers_cannot_do_is_refused_at_the_call(local_grid, call, match, traced):
    """Before: the worker ran it, then failed to encode its reply, and the client waited
    its whole timeout. Now nothing is sent, and the pointer is unchanged."""
    a = torch.randn(3)
    p = gg.send(a, local_grid.workers[0])
    local_grid.reset_stats()
    with pytest.raises(gg.RecordError, match=match):
        with gg.trace() if traced else contextlib.nullcontext():
            call(p)
    assert local_grid.stats()["messages"] == 0
    assert not local_grid.client.graph.pending
    assert torch.equal(p.get(), a)


@pytest.mark.parametrize("traced", [True, False], ids=["traced", "eager"])
def test_unsigned_results_travel(local_grid, traced):
    """hash_tensor makes uint64: once refused at the call, now carried by the wire. (It came
    with a newer torch than 2.6; there, a conversion makes the uint64.)"""
    a = torch.randn(4, 3)
    p = gg.send(a, local_grid.workers[0])
    uint64 = getattr(torch, "hash_tensor", lambda t, dim: t.to(torch.int64).to(torch.uint64))
    with gg.trace() if traced else contextlib.nullcontext():
        h = uint64(p, dim=1)
        u = (p * 100).to(torch.int32).abs().to(torch.uint32)
    assert h.dtype == torch.uint64
    assert torch.equal(h.get(), uint64(a, dim=1))
    assert torch.equal(u.get(), (a * 100).to(torch.int32).abs().to(torch.uint32))


@torch.library.custom_op("gridgraph_test::scaled_add", mutates_args=())
def scaled_add(x: torch.Tensor, y: torch.Tensor, alpha: float) -> torch.Tensor:
    return x + alpha * y


@pytest.mark.parametrize("traced", [True, False], ids=["traced", "eager"])
def test_ops_workers_refuse_run_as_torchs_decomposition(local_grid, traced):
    """_unsafe_masked_index is off the workers' allowlist (it skips bounds checks), and a
    torch.library custom op is not in the aten namespace: both are recorded as what torch
    decomposes them into (the custom op: its own Python implementation)."""
    x, y = torch.randn(4, 3), torch.randn(4, 3)
    mask, index = torch.tensor([[True], [False], [True], [True]]), torch.tensor([3, 9, 0, 1])

    def fn(x, y):
        return torch.ops.aten._unsafe_masked_index(x, mask, [index], -1.0), scaled_add(x, y, 0.5)

    want = fn(x, y)
    w0, w1, _ = local_grid.workers
    with gg.trace() if traced else contextlib.nullcontext():
        got = fn(gg.send(x, w0), gg.send(y, w1))
    torch.testing.assert_close([p.get() for p in got], list(want))


@pytest.mark.parametrize("traced", [True, False], ids=["traced", "eager"])
def test_a_sent_view_is_its_values_from_offset_zero(local_grid, traced):
    """gg.send(base[5:15]) stores the ten values, from offset 0 of their own storage: the
    pointer says so too, so as_strided and its gradient address those values (before, the
    pointer kept the sender's offset 5 and the gradient came out zero)."""
    base = torch.randn(20)
    x, grad_out = base[5:15], torch.randn(2, 2)
    local = x.clone().requires_grad_(True)
    want = torch.as_strided(local, (2, 2), (1, 2), storage_offset=0)
    (want_grad,) = torch.autograd.grad(want, local, grad_out)
    p = gg.send(x, local_grid.workers[0]).requires_grad_(True)
    assert p.storage_offset() == 0 and p.stride() == (1,)
    with gg.trace() if traced else contextlib.nullcontext():
        got = torch.as_strided(p, (2, 2), (1, 2), storage_offset=0)
        (got_grad,) = torch.autograd.grad(got, p, gg.send(grad_out, local_grid.workers[1]))
    assert torch.equal(got.get(), want.detach()) and torch.equal(got_grad.get(), want_grad)
    # A local view mixed into an op is shipped the same way.
    assert torch.equal((p.detach() + x).get(), x + x)


def test_a_session_the_worker_ended_raises_session_lost(local_grid):
    # A lease that ran out (or an eviction) ends a client's session on a worker, with the
    # tensors it held there: the client's next request there says so, as SessionLost.
    x = torch.ones(3).send(local_grid.workers[0])
    (session,) = local_grid.local_workers[0].sessions.values()  # this client's one session
    with session.cv:
        session.closed = True  # ended, as its lease running out ends it
    with pytest.raises(gg.SessionLost, match="session ended"):
        x.get()


def test_a_session_whose_lease_ran_out_raises_session_lost_naming_the_lease(local_grid):
    # Once the worker has dropped the ended session, the client's next request must not
    # open a fresh, empty one there and fail as "value not stored": it names the cause.
    x = torch.ones(3).send(local_grid.workers[0])
    worker = local_grid.local_workers[0]
    (session,) = worker.sessions.values()
    with session.cv:
        session.last_seen -= 60.0  # silent for a minute, as far as the worker knows
    worker.expire_clients(lease=30.0)
    assert not worker.sessions
    with pytest.raises(gg.SessionLost, match="lease"):
        x.get()
    with pytest.raises(gg.SessionLost, match="lease"):  # and so does every later request
        torch.zeros(2).send(local_grid.workers[0])
    assert not worker.sessions  # none was opened again for it
    y = torch.randn(3)  # another client of the same worker is served as before
    with gg.local_grid(1) as other:
        assert torch.equal((y.send(other.workers[0]) * 2).get(), y * 2)


def test_a_run_on_several_workers_wakes_its_caller_once(local_grid):
    # The caller waits for every worker's reply. One that comes early must not wake it: on a
    # local grid a woken caller takes the interpreter lock from the workers still running.
    x, y = torch.randn(8), torch.randn(8)
    a, b = x.send(local_grid.workers[0]), y.send(local_grid.workers[1])
    wakes = []

    class CountingCondition(threading.Condition):
        def notify_all(self) -> None:
            wakes.append(1)
            super().notify_all()

    local_grid.client.requests._cv = CountingCondition()
    for _ in range(5):
        with gg.trace():
            c, d = a * 2, b * 3  # one run: a part on each worker, two replies
        gg.compute(c, d)  # (returns once sent)
        local_grid.sync()  # waits for both replies
    assert len(wakes) <= 5  # once per run at most (none if both came before it waited)
    assert torch.equal(c.get(), x * 2) and torch.equal(d.get(), y * 3)


@pytest.mark.parametrize("re", [[1, 2], {"a": 1}, 7, None], ids=["list", "map", "int", "none"])
def test_a_reply_naming_no_request_id_is_dropped_quietly(local_grid, re):
    # Any peer on the bus can publish to a client's topic: a "reply" whose request id is not
    # a string (a list does not even hash) is dropped, and the client goes on working.
    x = torch.randn(4)
    p = x.send(local_grid.workers[0])
    mallory = local_grid.client.transport._bus.endpoint("mallory")
    forged = wire.encode({"kind": "reply", "re": re, "ok": True})
    mallory.publish(local_grid.client.topic, forged)  # raised in the client's handler before
    assert torch.equal((p * 2).get(), x * 2)


def _client_of_a_worker_answering(reply_to: Callable[[str], dict]) -> Client:
    """A client of worker w0 on a local bus, where w0 answers every request with
    `reply_to(its id)`, as a broken or hostile worker may. Its identity is not its name,
    as on IPFS."""
    bus = LocalBus()
    client = Client(bus.endpoint("client"), ["w0"])
    worker = bus.endpoint("identity-of-w0")

    def answer(sender: str, payload: bytes) -> None:
        msg = wire.decode(payload)
        worker.publish(client_topic(sender, msg["session"]), wire.encode(reply_to(msg["id"])))

    worker.subscribe(worker_topic("w0"), answer)
    return client


@pytest.mark.parametrize("error", [5, "boom", None, [1]], ids=["int", "text", "none", "list"])
def test_an_error_reply_without_an_error_map_raises_a_remote_error(error):
    # A worker (one the client chose; it may be broken or hostile) answered "ok": false with
    # an error that is not a map: the client raised AttributeError from deep inside a wait.
    client = _client_of_a_worker_answering(
        lambda rid: {"kind": "reply", "re": rid, "ok": False, "error": error}
    )
    with pytest.raises(gg.RemoteError, match="malformed error reply"):
        client.request("w0", {"kind": "ping"})
    rid = client.requests.send("w0", {"kind": "ping"})  # (the reply to a run's request, as a run
    with client.requests._cv:  # reads it: its error names the worker, not its transport identity)
        reply = client.requests._take_replies({"w0": rid})["w0"]
    assert client._remote_error(reply["error"], []).worker == "w0"
    with pytest.raises(gg.RemoteError, match="malformed error reply"):
        client.requests.send("w0", {"kind": "free"}, awaited=False)  # (its reply is read too)
        client.request("w0", {"kind": "ping"})


def test_an_error_reply_naming_another_worker_names_the_one_that_sent_it():
    # A worker's error named whatever worker it said: a hostile one made the client raise
    # SessionLost for an innocent worker w1.
    client = _client_of_a_worker_answering(
        lambda rid: {"kind": "reply", "re": rid, "ok": False,
                     "error": {"worker": "w1", "code": "session-ended", "message": "gone"}}
    )  # fmt: skip
    rid = client.requests.send("w0", {"kind": "ping"})
    with client.requests._cv:
        reply = client.requests._take_replies({"w0": rid})["w0"]
    lost = client._remote_error(reply["error"], [])
    assert isinstance(lost, gg.SessionLost) and lost.worker == "w0"


@pytest.mark.parametrize(
    "field", ["ok", "code", "refused", "upstream"], ids=lambda f: f"unhashable-{f}"
)
def test_an_error_reply_whose_fields_are_not_plain_raises_a_remote_error(field):
    # A list as an error's code, or a tensor as "ok", raised TypeError or RuntimeError
    # (the truth value of a tensor) in the client, on the transport's thread or in a wait.
    odd = torch.ones(2) if field == "ok" else [1]

    def reply_to(rid: str) -> dict:
        error = {"message": "no", "refused": True, "code": "x"}
        reply = {"kind": "reply", "re": rid, "ok": False, "error": error}
        (reply if field == "ok" else error)[field] = odd
        return reply

    client = _client_of_a_worker_answering(reply_to)
    client.requests.frees["w0"] = [1, 2]
    client.requests.send("w0", {"kind": "free"}, awaited=False)  # (its reply goes through the same)
    with pytest.raises(gg.RemoteError):
        client.request("w0", {"kind": "ping"})


@pytest.mark.parametrize("retry_after", [0, -1.0, float("nan"), float("inf"), True, "1"])
def test_a_client_refuses_a_wait_before_resending_that_is_not_a_positive_number(retry_after):
    # (0 made every wait for a reply resend the request in a loop)
    with pytest.raises(ValueError, match="retry_after"):
        Client(LocalBus().endpoint("client"), ["w0"], retry_after=retry_after)


def test_batches_of_frees_leave_nothing_behind_on_the_client(grid):
    # A batch of frees goes unawaited; its request and its reply were kept for ever, one of
    # each per FREE_BATCH values freed over a whole training run.
    w = grid.workers[0]
    x = torch.ones(2).send(w)
    stored = grid.stats()["workers"]["w0"]["objects"]
    for _ in range(3):
        with gg.trace():
            ys = [x + i for i in range(FREE_BATCH)]
        gg.compute(*ys)
        del ys
        gc.collect()
        with gg.trace():  # (recording releases the values of pointers that died)
            z = x * 2
        gg.compute(z)
        del z
    grid.sync()  # (runs return once sent: their replies are taken here)
    assert not grid.client.requests._outstanding and not grid.client.requests._replies
    assert grid.stats()["workers"]["w0"]["objects"] <= stored + FREE_BATCH  # they were freed
