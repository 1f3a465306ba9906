"""gg.compile: a step recorded once, replayed without its Python, equal to the traced step.

Each equality test trains three copies of one model from the same weights: plain torch, the
grid with every step in `gg.trace()`, and the grid with the step compiled. Values must be
bit-equal between the traced and the compiled step (the same ops on the same workers), and
equal to plain torch.
"""

from __future__ import annotations

import copy
import threading
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gridgraph as gg

STEPS = 6


def sgd(model: nn.Module) -> torch.optim.SGD:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, x, y, loss_fn=F.mse_loss):
    opt.zero_grad()
    loss = loss_fn(model(x), y)
    loss.backward()
    opt.step()
    return loss


def three_ways(grid, make_model, X, Y, loss_fn=F.mse_loss, where=None):
    """Train plain, traced and compiled copies; return (losses, models) of each, by name."""
    torch.manual_seed(0)
    plain = make_model()
    traced, compiled = copy.deepcopy(plain), copy.deepcopy(plain)
    w0, w1 = grid.workers[0], grid.workers[1]
    for model in (traced, compiled):
        (where or (lambda m: m.send(w0)))(model)
    x, y = X.send(w1), Y.send(w1)
    opts = {"plain": sgd(plain), "traced": sgd(traced), "compiled": sgd(compiled)}

    @gg.compile
    def step(x, y):
        return train_step(compiled, opts["compiled"], x, y, loss_fn)

    losses = {"plain": [], "traced": [], "compiled": []}
    for _ in range(STEPS):
        losses["plain"].append(train_step(plain, opts["plain"], X, Y, loss_fn).item())
        with gg.trace():
            loss = train_step(traced, opts["traced"], x, y, loss_fn)
        losses["traced"].append(loss.item())
        losses["compiled"].append(step(x, y).item())
    return losses, {"plain": plain, "traced": traced, "compiled": compiled}, step


def assert_same_state(models: dict, exact_plain: bool = True) -> None:
    """Parameters, buffers and grads: compiled == traced bit for bit; == plain torch."""
    named = {k: dict(m.state_dict(keep_vars=True)) for k, m in models.items()}
    for name, want in named["plain"].items():
        got, traced = named["compiled"][name], named["traced"][name]
        assert torch.equal(got.get(), traced.get()), name
        if exact_plain:
            assert torch.equal(got.get(), want), name
        else:
            torch.testing.assert_close(got.get(), want)
        if isinstance(want, nn.Parameter) or want.requires_grad:
            assert torch.equal(got.grad.get(), traced.grad.get()), f"{name}.grad"


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(13, 64), nn.ReLU(), nn.Linear(64, 1))


def test_compiled_mlp_equals_traced_and_torch(grid):
    X, Y = torch.randn(32, 13), torch.randn(32, 1)
    losses, models, step = three_ways(grid, mlp, X, Y)
    assert losses["compiled"] == losses["traced"] == losses["plain"]
    assert_same_state(models)
    # The first step makes the momentum buffers, so the 2nd and 3rd are the first alike.
    assert step.recordings == 3 and step.replays == STEPS - 3


def test_batchnorm_running_stats_updated_in_place(local_grid):
    X, Y = torch.randn(16, 3, 8, 8), torch.randint(0, 4, (16,))

    def cnn() -> nn.Module:
        return nn.Sequential(
            nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(144, 4)
        )

    def spread(model):
        model[0].send(local_grid.workers[0])
        model[1].send(local_grid.workers[2])
        model[4].send(local_grid.workers[0])

    losses, models, step = three_ways(local_grid, cnn, X, Y, F.cross_entropy, spread)
    assert losses["compiled"] == losses["traced"]
    # conv sums in another order on a worker (see intraop.py): equal to float32 rounding
    f32 = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731
    torch.testing.assert_close(f32(losses["compiled"]), f32(losses["plain"]))
    assert_same_state(models, exact_plain=False)
    bn = models["compiled"][1]
    assert bn.num_batches_tracked.get().item() == STEPS
    assert step.replays == STEPS - 3


def test_replayed_step_sends_no_more_messages_than_traced(local_grid):
    w0, w1 = local_grid.workers[:2]
    traced, compiled = mlp().send(w0), mlp().send(w0)
    t_opt, c_opt = sgd(traced), sgd(compiled)
    x, y = torch.randn(32, 13).send(w1), torch.randn(32, 1).send(w1)
    step = gg.compile(lambda x, y: train_step(compiled, c_opt, x, y))

    def messages(run) -> int:
        local_grid.client.compute_all()
        local_grid.reset_stats()
        run()
        local_grid.client.compute_all()  # the traced optimizer step runs with the next
        return local_grid.stats()["messages"]

    def traced_step():
        with gg.trace():
            loss = train_step(traced, t_opt, x, y)
        loss.item()

    for _ in range(4):
        traced_step(), step(x, y).item()
    assert step.replays == 1
    replayed = messages(lambda: step(x, y).item())  # the loss comes back with the run
    assert step.replays == 2
    assert replayed <= messages(traced_step)


def test_returned_pointers_and_grads_readable_after_replay(local_grid):
    w0 = local_grid.workers[0]
    model = nn.Linear(4, 2).send(w0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 4).send(local_grid.workers[1])

    @gg.compile
    def step(x):
        opt.zero_grad()
        out = model(x)
        loss = out.pow(2).mean()
        loss.backward()
        opt.step()
        return out, {"loss": loss}

    ref = nn.Linear(4, 2)
    ref.load_state_dict({k: v.get() for k, v in model.state_dict().items()})
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(4):
        out, extra = step(x)
        want_out = ref(x.get()).detach()
        want = train_step(ref, ref_opt, x.get(), None, lambda o, _: o.pow(2).mean())
        assert isinstance(out, gg.RemoteTensor)
        assert out.grad_fn is None or step.replays == 0  # a replay's results are detached
        assert torch.equal(out.get(), want_out)
        assert extra["loss"].item() == want.item()
        assert torch.equal(model.weight.grad.get(), ref.weight.grad)
        assert torch.equal(model.weight.get(), ref.weight.detach())
    assert step.replays == 2


def test_floats_and_local_tensors_passed_as_arguments_are_replayed(local_grid):
    w0 = local_grid.workers[0]
    p = torch.zeros(3).send(w0)
    ref = torch.zeros(3)

    @gg.compile
    def step(scale, bias):
        p.mul_(scale).add_(bias)
        return p.sum()

    for i in range(6):
        scale, bias = 1.0 + i / 10, torch.full((3,), float(i))
        total = step(scale, bias)
        ref.mul_(scale).add_(bias)
        assert total.item() == ref.sum().item()
        assert torch.equal(p.get(), ref)
    assert step.recordings == 2 and step.replays == 4


def test_new_batch_shape_records_again(local_grid):
    w0, w1 = local_grid.workers[:2]
    model = mlp().send(w0)
    opt = sgd(model)
    ref = copy.deepcopy(mlp())
    ref.load_state_dict({k: v.get() for k, v in model.state_dict().items()})
    ref_opt = sgd(ref)
    step = gg.compile(lambda x, y: train_step(model, opt, x, y))
    for batch in (32, 32, 32, 32, 8, 8, 8, 32):
        X, Y = torch.randn(batch, 13), torch.randn(batch, 1)
        got = step(X.send(w1), Y.send(w1)).item()
        assert got == train_step(ref, ref_opt, X, Y).item()
    # 32: three recordings then a replay; 8: two recordings then a replay; 32 replays again.
    assert (step.recordings, step.replays) == (5, 3)


@torch.no_grad()  # a forward pass alone replays only where its results need no grad_fn
def test_module_settings_are_guarded(local_grid):
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5)).send(local_grid.workers[0])
    x = torch.randn(2, 4).send(local_grid.workers[0])
    step = gg.compile(lambda x: model(x))
    model.eval()
    for _ in range(3):
        step(x)
    assert step.replays == 1
    model.train()
    local_grid.manual_seed(0)
    out = step(x)  # recorded again: dropout now
    assert step.recordings == 3
    local_grid.manual_seed(0)
    with gg.trace():
        want = model(x)
    assert torch.equal(out.get(), want.get())
    for p in (0.5, 0.5, 0.25):  # a replay, then recorded again: another dropout rate
        model[1].p = p
        local_grid.manual_seed(1)
        out = step(x)
        local_grid.manual_seed(1)
        with gg.trace():
            want = model(x)
        assert torch.equal(out.get(), want.get())
    assert (step.recordings, step.replays) == (5, 2)


def test_control_flow_on_remote_values_is_refused(local_grid):
    p = torch.ones(3).send(local_grid.workers[0])

    @gg.compile
    def step():
        if p.sum() > 0:  # a Python branch on a remote value
            p.add_(1)

    with pytest.raises(gg.GridError, match=r"test_compile.py:\d+.*cannot branch"):
        step()

    @gg.compile
    def data_dependent():
        return p.nonzero()

    with pytest.raises(gg.GridError, match="nonzero.*depends on the data"):
        data_dependent()


def test_changing_python_state_float_is_refused(local_grid):
    model = nn.Linear(4, 1).send(local_grid.workers[0])
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    x = torch.randn(8, 4).send(local_grid.workers[1])
    step = gg.compile(lambda x: train_step(model, opt, x, torch.zeros(8, 1)))
    step(x), step(x)  # the first makes Adam's state; the second and third are alike
    stale = r"aten::\w+.* recorded at .*test_compile.py:\d+ .*not an argument"
    with pytest.raises(gg.GridError, match=stale):
        step(x)
    assert step.replays == 0


@pytest.mark.parametrize("lr", [lambda: 0.1, lambda: torch.tensor(0.1)], ids=["float", "tensor"])
def test_lr_scheduler_change_records_once_then_replays_lr_as_an_argument(local_grid, lr):
    """The scheduler sets a float `lr`, or fills a tensor `lr` in place."""
    model = nn.Linear(4, 1).send(local_grid.workers[0])
    opt = torch.optim.SGD(model.parameters(), lr=lr())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    ref = nn.Linear(4, 1)
    ref.load_state_dict({k: v.get() for k, v in model.state_dict().items()})
    ref_opt = torch.optim.SGD(ref.parameters(), lr=lr())
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=4, gamma=0.5)
    X, Y = torch.randn(8, 4), torch.randn(8, 1)
    x, y = X.send(local_grid.workers[1]), Y.send(local_grid.workers[1])
    step = gg.compile(lambda x, y: train_step(model, opt, x, y))
    for _ in range(8):
        assert step(x, y).item() == train_step(ref, ref_opt, X, Y).item()
        sched.step(), ref_sched.step()
    assert torch.equal(model.weight.get(), ref.weight.detach())
    # steps 3-4 replay with lr as recorded; step 5 (lr changed) records again, and from
    # then on lr, seen to change between recordings, is an argument: steps 6-8 replay
    assert (step.recordings, step.replays) == (3, 5)


def test_remote_error_during_replay_names_the_line(local_grid):
    w0 = local_grid.workers[0]
    a = torch.ones(3).send(w0)

    @gg.compile
    def step(i):
        return a.index_select(0, i)  # the line the error must name

    for _ in range(3):
        step(torch.tensor([0, 1]).send(w0))
    assert step.replays == 1
    bad = step(torch.tensor([0, 7]).send(w0))  # returns once sent: nothing has failed yet
    later = step(torch.tensor([1, 2]).send(w0))  # a replay too (the same guard)
    assert step.recordings == 2  # the failed call was a replay
    with pytest.raises(gg.RemoteError) as err:
        later.get()  # the next sync point raises the failure, naming its line
    assert "test_compile.py" in err.value.where and err.value.op.startswith("aten::index_select")
    with pytest.raises(gg.RemoteError, match="index out of range"):
        bad.get()  # a value the failed step made is a failed one
    assert torch.equal(later.get(), torch.ones(2))  # raised once: a later step is its own
    assert torch.equal(step(torch.tensor([2]).send(w0)).get(), torch.ones(1))


def test_wrong_use_is_refused_at_the_call():
    with gg.local_grid(2) as one, gg.local_grid(2) as two:
        a, b = torch.ones(2).send(one.workers[0]), torch.ones(2).send(two.workers[0])
        add = gg.compile(lambda x, y: x + y)
        with pytest.raises(gg.GridError, match="two different grids"):
            add(a, b)
        assert torch.equal(add(x=a, y=a).get(), torch.full((2,), 2.0))  # kwargs work
    with pytest.raises(gg.GridError, match="closed"):
        add(x=a, y=a)
    with pytest.raises(TypeError):
        gg.compile(3)


def test_readme_example_runs(capsys):
    readme = (Path(__file__).parents[3] / "README.md").read_text()
    section = readme[readme.index("## Compiled steps") :]
    code = section[section.index("```python\n") + 10 : section.index("```\n", 10)]
    exec(compile(code, "README.md", "exec"), {})
    printed = capsys.readouterr().out.splitlines()
    # Recorded: the first three calls, and the first with weight 0.5 (the frozen argument
    # changed); then the argument is a parameter, replayed with either value.
    assert len(printed) == 3 and printed[-1].endswith("4 recorded, 20 replayed>")


def test_pointer_arguments_are_guarded_by_aliasing_and_identity(local_grid):
    w0 = local_grid.workers[0]
    a, b = torch.ones(2).send(w0), torch.full((2,), 3.0).send(w0)

    @gg.compile
    def add(x, y):
        return x + y + a  # `a` is also read through the closure

    for _ in range(3):
        assert torch.equal(add(a, a).get(), torch.full((2,), 3.0))
    assert add.replays == 1
    assert torch.equal(add(a, b).get(), torch.full((2,), 5.0))  # no longer one pointer
    assert torch.equal(add(b, b).get(), torch.full((2,), 7.0))  # not `a`: recorded again
    assert add.replays == 1


def test_python_ints_that_shape_the_ops_are_guards(local_grid):
    p = torch.arange(6.0).reshape(2, 3).send(local_grid.workers[0])
    reduce = gg.compile(lambda x, dim, scale: x.sum(dim) * scale)
    for dim, scale in [(0, 2), (0, 2), (0, 2), (1, 2), (0, 3), (1, 2), (1, 2)]:
        want = torch.arange(6.0).reshape(2, 3).sum(dim) * scale
        assert torch.equal(reduce(p, dim, scale).get(), want)
    assert (reduce.recordings, reduce.replays) == (5, 2)


def test_changes_to_the_model_between_calls_are_seen(local_grid):
    """A hook registered, a layer replaced, a parameter frozen, a gradient hook: each changes
    what the step computes without changing its arguments, so the next call records again."""
    torch.manual_seed(0)
    plain = mlp()
    model = copy.deepcopy(plain).send(local_grid.workers[0])
    opts = {"plain": torch.optim.SGD(plain.parameters(), lr=0.1),
            "grid": torch.optim.SGD(model.parameters(), lr=0.1)}  # fmt: skip
    X, Y = torch.randn(8, 13), torch.randn(8, 1)
    x, y = X.send(local_grid.workers[1]), Y.send(local_grid.workers[1])
    step = gg.compile(lambda x, y: train_step(model, opts["grid"], x, y))
    changes = {
        3: lambda m: m[0].register_forward_hook(lambda mod, inp, out: out * 2),
        6: lambda m: m.__setitem__(2, nn.Linear(64, 1).requires_grad_(False)),
        9: lambda m: m[0].weight.requires_grad_(False),
        12: lambda m: m[0].bias.register_hook(lambda g: g.clamp(-0.01, 0.01)),
    }
    for i in range(15):
        if i in changes:
            torch.manual_seed(i)
            changes[i](plain)
            torch.manual_seed(i)
            changes[i](model)
            if i == 6:
                model[2].send(local_grid.workers[0])
        want = train_step(plain, opts["plain"], X, Y).item()
        assert step(x, y).item() == want, i
        assert torch.equal(model[0].weight.get(), plain[0].weight.detach()), i
    assert step.replays == 5  # calls 2, 5, 8, 11 and 14: each change recorded twice again


def test_torch_modes_are_guarded(local_grid):
    model = nn.Linear(4, 1).send(local_grid.workers[0])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(2, 4).send(local_grid.workers[0])
    step = gg.compile(lambda x: train_step(model, opt, x, torch.zeros(2, 1)))
    for _ in range(3):
        step(x)
    assert step.replays == 1
    with torch.no_grad(), pytest.raises(RuntimeError, match="does not require grad"):
        step(x)  # as torch: no graph to run backward through
    forward = gg.compile(lambda x: model(x))
    for _ in range(3):
        out = forward(x)
        assert out.requires_grad and out.grad_fn is not None  # as torch: attached
    assert forward.replays == 0 and "requires grad" in forward.not_replayable
    with torch.no_grad():
        for _ in range(3):
            want = model(x).get()
            assert torch.equal(forward(x).get(), want)
    assert forward.replays == 1
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    pa, pb = a.send(local_grid.workers[0]), b.send(local_grid.workers[1])
    matmul = gg.compile(lambda x, y: x @ y + torch.ones(4))
    phases = [(False, torch.float32)] * 3 + [(True, torch.float32)] * 3
    phases += [(False, torch.float64)] * 3 + [(False, torch.float32)]
    with torch.no_grad():
        for autocast, default in phases:  # autocast to bfloat16; what torch.ones makes
            torch.set_default_dtype(default)
            try:
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                    got, want = matmul(pa, pb), a @ b + torch.ones(4)
            finally:
                torch.set_default_dtype(torch.float32)
            assert got.dtype == want.dtype and torch.equal(got.get(), want)
    assert matmul.replays == 4


def test_local_tensors_the_step_reads_are_read_at_each_call(local_grid):
    """A local tensor of the user's that the step mixes into its ops (through a closure) is
    sent as it is at each call, contiguous or not."""
    p = torch.zeros(3).send(local_grid.workers[0])
    ref = torch.zeros(3)
    scale, columns = torch.ones(3), torch.ones(3, 2)
    shift = columns[:, 0]  # not contiguous: sending it makes a copy

    @gg.compile
    def step():
        return p.mul_(scale).add_(shift).sum()

    for i in range(6):
        total = step()
        ref.mul_(scale).add_(shift)
        assert total.item() == ref.sum().item() and torch.equal(p.get(), ref)
        if i >= 2:  # between calls, once replays began (a change between the two
            scale.add_(i % 2), columns.mul_(2)  # recordings is refused: not an argument)
    assert step.replays == 4


def test_compiled_steps_called_from_threads(local_grid):
    """Steps compiled and called on several threads at once, on one grid: each thread's
    results are its own, as in torch (recordings on one client used to mix)."""
    results: dict[int, list] = {}

    def run(k: int) -> None:
        p = torch.zeros(4).send(local_grid.workers[k])
        ref = torch.zeros(4)
        step = gg.compile(lambda s: p.add_(s).mul(2))
        got = []
        try:
            for i in range(30):
                got.append(torch.equal(step(float(i % 3 + k)).get(), ref.add_(i % 3 + k) * 2))
        except Exception as e:  # noqa: BLE001 - reported below, with the thread's number
            got.append(e)
        results[k] = got

    threads = [threading.Thread(target=run, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {k: [True] * 30 for k in range(3)}


def test_pointers_inside_list_and_dict_arguments_are_arguments(local_grid):
    """A pointer passed inside a list or dict is read from each call's container, not the
    recorded one (which may still be alive)."""
    w0 = local_grid.workers[0]
    step = gg.compile(lambda xs, named: xs[0] * 2 + xs[1] - named["z"])
    values = [torch.randn(3) for _ in range(4)]
    a, b, c, d = [v.send(w0) for v in values]
    calls = [(a, b, c)] * 3 + [(c, d, a), (b, a, d), (b, a, d)]
    for x, y, z in calls:
        want = x.get() * 2 + y.get() - z.get()
        assert torch.equal(step([x, y], {"z": z}).get(), want)  # new containers each call
    assert step.replays == 3


def test_complex_arguments_are_guarded_bit_for_bit(local_grid):
    z = torch.tensor([1 + 1j, -1 - 2j])
    p = gg.send(z, local_grid.workers[0])
    step = gg.compile(lambda p, c: p * c)
    for c in [0j, 0j, 0j, complex(0.0, -0.0), complex(-0.0, -0.0)]:
        want = torch.view_as_real(z * c)
        assert torch.equal(torch.view_as_real(step(p, c).get()).signbit(), want.signbit()), c


@torch.no_grad()
def test_random_ops_draw_on_as_traced_steps_do(local_grid):
    """A replayed dropout draws the next numbers of the worker's stream, as the same step
    traced (or in torch, seeded alike) would: a replay repeats no draws."""
    x = torch.ones(4, 8)
    p = x.send(local_grid.workers[0])
    step = gg.compile(lambda p: F.dropout(p, 0.5))
    local_grid.workers[0].manual_seed(3)
    got = [step(p).get() for _ in range(5)]
    torch.manual_seed(3)
    assert all(torch.equal(g, F.dropout(x, 0.5)) for g in got)
    assert step.replays == 3


def test_gradients_accumulate_across_replays_as_in_torch(local_grid):
    """A step that only runs backward (no zero_grad) adds to `.grad` on every call, replays
    included; clearing `.grad` between calls is seen."""
    torch.manual_seed(0)
    plain = nn.Linear(4, 1)
    model = copy.deepcopy(plain).send(local_grid.workers[0])
    X = torch.randn(8, 4)
    x = X.send(local_grid.workers[1])

    def backward(model, x):
        loss = model(x).pow(2).mean()
        loss.backward()
        return loss

    step = gg.compile(lambda x: backward(model, x))
    for i in range(9):
        if i == 4:
            model.zero_grad(), plain.zero_grad()  # grads to None: recorded again
        assert step(x).item() == backward(plain, X).item()
        assert torch.equal(model.weight.grad.get(), plain.weight.grad), i
    # Recorded: the first call (it makes the grads), then two alike; again after zero_grad.
    assert (step.recordings, step.replays) == (6, 3)


def test_a_pointer_the_step_reads_moved_between_calls(local_grid):
    w0, w1 = local_grid.workers[:2]
    a = torch.arange(3.0).send(w0)
    step = gg.compile(lambda x: x * a)
    x = torch.ones(3).send(w1)
    for i in range(6):
        if i == 3:
            a.move(w1)  # recorded again: its value is elsewhere now
        assert torch.equal(step(x).get(), torch.arange(3.0))
    assert (step.recordings, step.replays) == (4, 2)


def _schedule(kind: str, opt: torch.optim.Optimizer):
    if kind == "cosine per step":
        return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=30)
    return torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)  # per epoch of 5


@pytest.mark.parametrize(
    "kind, lr, counts",
    [
        ("cosine per step", lambda: 0.05, (3, 27)),  # it was 30 recorded, 0 replayed
        ("cosine per step", lambda: torch.tensor(0.05), (3, 27)),
        ("step per epoch", lambda: 0.05, (4, 26)),  # it was 3 more recordings each epoch
    ],
    ids=["cosine-float", "cosine-tensor", "steplr"],
)
def test_lr_schedulers_replay_with_the_learning_rate_as_an_argument(local_grid, kind, lr, counts):
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 1))
    model = copy.deepcopy(ref).send(local_grid.workers[0])
    opt = torch.optim.SGD(model.parameters(), lr=lr(), momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=lr(), momentum=0.9)
    sched, ref_sched = _schedule(kind, opt), _schedule(kind, ref_opt)
    X, Y = torch.randn(16, 6), torch.randn(16, 1)
    x, y = X.send(local_grid.workers[1]), Y.send(local_grid.workers[1])
    step = gg.compile(lambda x, y: train_step(model, opt, x, y))
    with warnings.catch_warnings():
        warnings.simplefilter("error", gg.RecompileWarning)  # a working schedule: no warning
        for _ in range(30):
            assert step(x, y).item() == train_step(ref, ref_opt, X, Y).item()
            sched.step(), ref_sched.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.get(), q.detach())
    assert (step.recordings, step.replays) == counts


def test_a_scheduler_stepped_inside_the_step_is_not_replayed(local_grid):
    model = nn.Linear(4, 1).send(local_grid.workers[0])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    x, y = torch.randn(8, 4).send(local_grid.workers[0]), torch.randn(8, 1)

    def inside(x, y):
        loss = train_step(model, opt, x, y)
        sched.step()  # Python: a replay would not run it
        return loss

    step = gg.compile(inside)
    for _ in range(3):
        step(x, y)
    assert step.replays == 0 and "step the LR scheduler outside" in step.not_replayable


def test_a_step_that_keeps_recording_warns_once_naming_the_guard_and_line(local_grid):
    w0 = local_grid.workers[0]
    double = gg.compile(lambda x: x * 2)
    with pytest.warns(gg.RecompileWarning) as caught:
        for n in range(1, 8):
            double(torch.ones(n).send(w0))  # a new shape every call: never replays
    [warning] = caught.list
    message = str(warning.message)
    assert "recorded 4 times and replayed 0" in message
    assert "argument 'x' changed its guard: pointer (3,) torch.float32 on w0 -> pointer (4,)" in (
        message
    )
    assert f"test_compile.py:{_line('double(torch.ones(n)')}" in message  # the user's call
    assert warning.filename == __file__


def test_a_step_that_records_again_after_replaying_warns_with_the_reason(local_grid):
    model = nn.Sequential(nn.Linear(4, 4)).send(local_grid.workers[0])
    x = torch.randn(2, 4).send(local_grid.workers[0])
    forward = gg.compile(lambda x: model(x).detach())
    for _ in range(3):
        forward(x)
    assert forward.replays == 1
    with pytest.warns(gg.RecompileWarning, match="a module's settings") as caught:
        for i in range(6):
            model[0].calls = i  # a module setting new at every call: each call records
            forward(x)
    assert len(caught.list) == 1


def _line(text: str) -> int:
    for i, line in enumerate(Path(__file__).read_text().splitlines(), 1):
        if text in line and "_line(" not in line.replace(text, ""):
            return i
    raise AssertionError(text)


def test_two_learning_rates_equal_while_recorded_are_each_read_when_they_part(local_grid):
    """Two param groups with one schedule (weight decay on one only, as transformers are
    trained): their lr are equal in both recordings. The step replays, and reads each
    group's own lr once they part (here the user raises one)."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 1))
    model = copy.deepcopy(ref).send(local_grid.workers[0])

    def groups(m):
        return [{"params": m[0].parameters(), "weight_decay": 0.01}, {"params": m[2].parameters()}]

    opt = torch.optim.SGD(groups(model), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(groups(ref), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=20)
    ref_sched = torch.optim.lr_scheduler.CosineAnnealingLR(ref_opt, T_max=20)
    X, Y = torch.randn(16, 6), torch.randn(16, 1)
    x, y = X.send(local_grid.workers[1]), Y.send(local_grid.workers[1])
    step = gg.compile(lambda x, y: train_step(model, opt, x, y))
    for i in range(16):
        if i == 10:  # the head's group only: the groups' lr part
            for o in (opt, ref_opt):
                o.param_groups[1]["lr"] *= 10
        assert step(x, y).item() == train_step(ref, ref_opt, X, Y).item()
        sched.step(), ref_sched.step()
        if i == 9:
            assert (step.recordings, step.replays) == (3, 7)  # as with one group
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.get(), q.detach())
