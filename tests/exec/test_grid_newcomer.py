"""What a newcomer meets on a grid: errors that say what to do, copying and bringing models
home, stats that report lost workers. Each compares with plain torch where it computes."""

from __future__ import annotations

import copy
import dataclasses
import subprocess
import sys
import textwrap

import pytest
import torch

import gridgraph as gg


def mlp() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def test_a_model_sent_in_part_names_the_unsent_parameters_at_the_call(local_grid):
    model = mlp()
    model[0].send(local_grid.workers[0])  # model[2] forgotten
    x = torch.randn(3, 4).send(local_grid.workers[1])
    with pytest.raises(gg.GridError) as raised:
        model(x)  # before: a RecordError deep inside opt.step(), naming nothing
    message = str(raised.value)
    assert "2.weight, 2.bias of your Sequential are still local" in message
    assert "test_grid_newcomer.py" in message and "model.send(worker)" in message
    with torch.no_grad():  # no gradient to go wrong: a local weight may be shipped
        y = model(x)
    expected = mlp()[2](torch.relu(torch.nn.functional.linear(
        x.get(), model[0].weight.get(), model[0].bias.get())))  # fmt: skip
    torch.testing.assert_close(y.get(), expected)


def test_deepcopy_of_a_pointer_is_a_remote_copy(local_grid):
    a = torch.randn(5, 3)
    p = a.send(local_grid.workers[2]).requires_grad_(True)
    q = copy.deepcopy(p)  # before: TypeError: cannot pickle '_thread.lock' object
    assert isinstance(q, gg.RemoteTensor) and q is not p and q._vid != p._vid
    assert q.location == "w2" and q.requires_grad and q.is_leaf
    with torch.no_grad():
        p.mul_(2)  # the copy does not share the original's storage
    torch.testing.assert_close(q.get(), a)
    torch.testing.assert_close(p.get(), 2 * a)


def test_deepcopy_of_a_sent_model_trains_apart_then_comes_home(local_grid):
    model = mlp()
    model.send(local_grid.workers[0])
    ema = copy.deepcopy(model)  # the EMA / best-checkpoint pattern
    assert all(isinstance(p, gg.RemoteTensor) and isinstance(p, torch.nn.Parameter)
               for p in ema.parameters())  # fmt: skip
    x, y = torch.randn(6, 4), torch.randint(0, 2, (6,))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    loss = torch.nn.functional.cross_entropy(model(x.send(local_grid.workers[0])),
                                             y.send(local_grid.workers[0]))  # fmt: skip
    loss.backward()
    opt.step()
    reference = mlp()
    torch.nn.functional.cross_entropy(reference(x), y).backward()
    torch.optim.SGD(reference.parameters(), lr=0.5).step()
    assert ema.get() is ema and model.get() is model  # home, in place
    for p, q, r, fresh in zip(model.parameters(), ema.parameters(), reference.parameters(),
                              mlp().parameters()):  # fmt: skip
        assert type(p) is torch.nn.Parameter and type(q) is torch.nn.Parameter
        torch.testing.assert_close(p, r)  # trained
        torch.testing.assert_close(q, fresh)  # the copy kept the weights it was made with
        torch.testing.assert_close(p.grad, r.grad)
    torch.testing.assert_close(model(x), reference(x))  # an ordinary local model again


def test_gg_get_brings_buffers_home_too(local_grid):
    model = torch.nn.BatchNorm1d(3)
    model.running_mean.add_(torch.arange(3.0))
    gg.send(model, local_grid.workers[1])
    assert isinstance(model.running_mean, gg.RemoteTensor)
    gg.get(model)
    assert type(model.running_mean) is torch.Tensor
    torch.testing.assert_close(model.running_mean, torch.arange(3.0))
    with pytest.raises(TypeError, match="pointer or an nn.Module"):
        gg.get(3)


@pytest.mark.parametrize("move", [lambda p: p.cuda(), lambda p: p.to("cuda:0"),
                                  lambda p: p.to(device="cuda", dtype=torch.half)])  # fmt: skip
def test_cuda_on_a_pointer_is_a_grid_error_saying_what_to_do(local_grid, move):
    p = torch.ones(3).send(local_grid.workers[0])
    with pytest.raises(gg.GridError, match=r"computes on CPU; bring it home first \(p.get\(\)"):
        move(p)  # before: torch's "Found no NVIDIA driver on your system"
    assert torch.equal(p.to(torch.float64).get(), torch.ones(3, dtype=torch.float64))
    # every form torch's .to takes still works (copy= too: the check must not refuse it)
    for args, kwargs in [((torch.float64,), {"copy": True}), (("cpu",), {"copy": False}),
                         ((), {"dtype": torch.int64, "non_blocking": True})]:  # fmt: skip
        torch.testing.assert_close(p.to(*args, **kwargs).get(), torch.ones(3).to(*args, **kwargs))


def test_stats_report_a_lost_worker_instead_of_raising(local_grid):
    p = torch.ones(4).send(local_grid.workers[0])
    local_grid.local_workers[1].close()  # w1 stops answering, and its heartbeats stop:
    local_grid.client.alive = lambda w: w != "w1"
    stats = local_grid.stats()  # before: WorkerLost
    assert set(stats["lost"]) == {"w1"} and "stopped answering" in stats["lost"]["w1"]
    assert set(stats["workers"]) == {"w0", "w2"} and stats["workers"]["w0"]["objects"] == 1
    assert p.location == "w0"


def test_a_closed_grids_pointer_does_not_say_computed():
    with gg.local_grid(1) as grid:
        p = torch.ones(2).send(grid.workers[0])
        assert "computed=True" in repr(p)
    assert "computed=True" not in repr(p) and "grid closed" in repr(p)
    assert not p.computed and p.location is None
    with pytest.raises(gg.GridError, match="closed"):
        p.get()


def test_an_isolated_grid_without_a_main_guard_is_named_in_one_line(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent("""
        import torch, gridgraph as gg
        with gg.local_grid(1, isolate=True) as grid:   # no `if __name__ == "__main__":`
            print((torch.ones(3).send(grid.workers[0]) + 1).get())
    """)
    )
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            timeout=300)  # fmt: skip
    assert result.returncode != 0
    assert result.stderr.count("Traceback") == 1, result.stderr  # before: 13, in 569 lines
    last = result.stderr.strip().splitlines()[-1]
    assert "gg.SessionLost" in last or "SessionLost" in last
    assert 'if __name__ == "__main__":' in last


def test_sends_over_the_message_limit_go_in_pieces_and_runs_over_it_are_refused():
    limits = dataclasses.replace(gg.Limits.unlimited(), max_message_bytes=1 << 20)
    with gg.local_grid(2, limits=limits) as grid:
        w0, w1 = grid.workers
        a, b, c = torch.randn(700, 1000), torch.arange(10.0), torch.randn(100, 1000)
        grid.reset_stats()
        pa, pb, pc = grid.send_many([a, b, c], w0)  # 2.8 MB: three pieces; b and c: one put
        puts = grid.stats()["messages"]
        assert torch.equal(pa.get(), a) and torch.equal(pb.get(), b) and torch.equal(pc.get(), c)
        assert puts == 2 * (3 + 1 + 3)  # requests and replies: 3 pieces and 1 put, 3 copies
        t = a.t().send(w1).requires_grad_()  # not contiguous: sent as it arrives
        assert t.is_leaf and t.requires_grad and torch.equal(t.get(), a.t())
        weight = torch.nn.Parameter(torch.randn(300, 1000))  # a parameter over the limit
        model = torch.nn.Linear(1000, 300, bias=False)
        model.weight = weight
        model.send(w1)
        assert model.weight.is_leaf and isinstance(model.weight, torch.nn.Parameter)
        x = torch.randn(2, 1000)
        model(x.send(w1)).sum().backward()
        torch.optim.SGD(model.parameters(), lr=0.1).step()
        expected = weight.detach() - 0.1 * x.sum(0).expand(300, 1000)
        torch.testing.assert_close(model.weight.get(), expected)
        with pytest.raises(gg.GridError, match=r"'run' request is 1.1 MiB, over the 1.0 MiB"):
            (pa.reshape(-1)[:300_000] + torch.randn(300_000)).get()  # ships 1.2 MB with the op
        torch.testing.assert_close((pb * torch.ones(10)).get(), b)


def test_many_ops_outside_trace_give_one_hint_at_the_users_line(local_grid):
    p = torch.ones(4).send(local_grid.workers[0])
    with gg.trace():
        for _ in range(150):
            p = p + 1
    p.compute()  # recorded: no hint
    with pytest.warns(gg.GridHint, match="100 ops on pointers ran one at a time") as hints:
        for _ in range(250):
            p = p + 1  # each one round trip
    assert len(hints) == 1 and hints[0].filename == __file__
    assert torch.equal(p.get(), torch.full((4,), 401.0))


def test_stats_say_where_the_time_went(local_grid):
    x = torch.randn(300, 300).send(local_grid.workers[1])
    local_grid.reset_stats()
    for _ in range(3):
        with gg.trace():
            y = (x @ x).sum()
        y.compute()
    stats = local_grid.stats()
    assert stats["runs"] == 3 and stats["run_s"] > 0
    busy = stats["workers"]["w1"]["busy_s"]
    assert 0 < busy <= stats["run_s"] and stats["workers"]["w0"]["busy_s"] == 0
    local_grid.reset_stats()
    assert local_grid.stats()["runs"] == 0


def test_a_grid_imports_what_the_first_ops_meta_kernel_needs_in_the_background():
    script = textwrap.dedent("""
        import sys, threading, torch, gridgraph as gg
        assert "torch._dynamo" not in sys.modules
        with gg.local_grid(1) as grid:
            for t in threading.enumerate():
                if t.name == "gridgraph-warm-up":
                    t.join()
            print("torch._dynamo" in sys.modules)  # before any op
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=300)  # fmt: skip
    assert result.stdout.strip() == "True", result.stderr


def test_a_transfer_over_the_receivers_message_limit_is_refused_before_the_run():
    limits = dataclasses.replace(gg.Limits.unlimited(), max_message_bytes=1 << 20)
    with gg.local_grid(2, limits=limits) as grid:
        w0, w1 = grid.workers
        a, b = torch.randn(600, 1000), torch.ones(3)
        pa, pb = a.send(w0), b.send(w1)  # 2.4 MB: sent in pieces
        with gg.trace(), gg.on(w1):
            y = pa.sum() + pb  # placed on w1: pa would travel whole
        with pytest.raises(gg.GridError, match=r"moves 2.3 MiB from 'w0' to 'w1' in one"):
            y.get()  # before: dropped there, and the run waited for it
        with gg.trace(), gg.on(w0):
            s = pa.sum()
        torch.testing.assert_close((s + pb).get(), a.sum() + b)  # a scalar travels
