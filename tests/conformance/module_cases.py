"""One ModuleInfo entry, one dtype, one mode: train its inputs through pointers, against torch.

A *unit* is (module, dtype, mode); `run_unit` runs every `ModuleInput` the entry yields (the
first FIRST_SAMPLES for float64) and returns one `Outcome` for it, with the samples that
failed or were refused counted (`Outcome.failed`: the ModuleInfo target is a share of
samples, refusals counting as failures):

    pass      every sample gives what plain torch gives on the same inputs
    refused   the module is in `refused.REFUSED` and raised `gg.GridError` at the call for
              some samples, and the others passed
    fail      any sample failed: an error at the call or at `.get()`, a wrong value, a
              refusal of a module that is not in the list (the sweep adds crashes and hangs)

Modes: the module in training or eval mode (`train-*`, `eval-*`; eval only for the entries
whose ModuleInfo says the two differ), run eagerly on pointers or recorded inside
`gg.trace()` and computed together (`*-eager`, `*-traced`).

One sample: the module is built twice from the entry's constructor input under one seed
(one copy stays local, the other is sent to w0, parameters and buffers); the forward
input's tensors are sent alternating between w0 and w1. Both copies run the forward, then
the backward of the sum of every floating-point output that requires grad. Compared with
the local copy: the outputs, the parameter and input gradients, the parameters and buffers
afterwards (running statistics, an embedding renormalised in place) and the inputs
(in-place modules), by `opinfo_cases.compare`, with the entry's own tolerances. Random
modules draw the same numbers: torch's generator and the workers' are seeded with 42
before each forward.
"""

from __future__ import annotations

import collections
import copy
import itertools
import time
import warnings

import torch

import gridgraph as gg
from tests.conformance.opinfo_cases import (
    Outcome,
    SampleFailure,
    at_call,
    both_reject,
    clone,
    compare,
    describe,
    fetched,
    first_line,
    map_tensors,
    spread,
    summary,
    tensors_in,
)
from tests.conformance.refused import REFUSED

DTYPES = {"float32": torch.float32, "float64": torch.float64}
MODES = ("train-eager", "train-traced", "eval-eager", "eval-traced")

# float32 runs every input the entry yields; float64 the first this many.
FIRST_SAMPLES = 3

SEED = 42


def entry_id(info) -> str:
    """The entry's name as the suite reports it: `nn.LSTM`."""
    return info.name


def load_entries() -> dict:
    """ModuleInfo entries by name, in module_db order."""
    from torch.testing._internal.common_modules import module_db

    return {entry_id(info): info for info in module_db}


def units_of(info, dtypes=tuple(DTYPES), modes=MODES) -> list[tuple[str, str]]:
    """The (dtype, mode) units the suite runs for a module: eval mode only where the entry
    says it differs from training (`train_and_eval_differ`), as torch's own module tests."""
    supported = info.supported_dtypes("cpu")
    if not info.train_and_eval_differ:
        modes = [m for m in modes if m.startswith("train")]
    return [(d, m) for d in dtypes if DTYPES[d] in supported for m in modes]


def run_unit(info, dtype: str, mode: str, progress=lambda i: None) -> Outcome:
    """Run one unit of a ModuleInfo entry on a fresh 2-worker local grid: every sample,
    the failing ones counted; the message is the first failure's."""
    entry = entry_id(info)
    training, traced = mode.startswith("train"), mode.endswith("traced")
    limit = None if dtype == "float32" else FIRST_SAMPLES
    verdicts: collections.Counter = collections.Counter()
    first: tuple[int, SampleFailure] | None = None
    slowest = 0.0
    try:
        torch.manual_seed(0)  # the same inputs whatever ran before in this process
        inputs = info.module_inputs_func(
            info, device="cpu", dtype=DTYPES[dtype], requires_grad=True, training=training
        )
        inputs = [i for i in inputs if i.forward_input is not None]
        with gg.local_grid(2) as grid, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for i, module_input in enumerate(itertools.islice(inputs, limit)):
                progress(i)
                start = time.monotonic()
                try:
                    verdicts[check_sample(grid, info, module_input, dtype, training, traced)] += 1
                except SampleFailure as f:
                    if f.kind == "refusal" and entry in REFUSED:
                        verdicts["refused"] += 1
                    else:
                        verdicts["failed"] += 1
                        first = first or (i, f)
                slowest = max(slowest, time.monotonic() - start)
    except Exception as e:  # the harness itself (input generation, grid setup)
        return Outcome(entry, dtype, mode, "fail", "error", describe(e), detail=summary(e))
    counts = dict(samples=sum(verdicts.values()), inexact=verdicts["close"],
                  rejected=verdicts["rejected"], slowest=round(slowest, 3),
                  failed=verdicts["failed"] + verdicts["refused"])  # fmt: skip
    if first is not None:
        i, f = first
        return Outcome(entry, dtype, mode, "fail", f.kind, f"sample {i}: {first_line(f)}",
                       detail=f.detail, **counts)  # fmt: skip
    return Outcome(entry, dtype, mode, "refused" if verdicts["refused"] else "pass", **counts)


# --- one sample --------------------------------------------------------------------------


def check_sample(grid: gg.Grid, info, module_input, dtype: str, training: bool, traced: bool):
    """The module's forward and backward on pointers against torch on local copies: the
    verdict "exact", "close" or "rejected" (torch rejects it, and so do the pointers)."""
    forward = module_input.forward_input
    parts = (tuple(forward.args), dict(forward.kwargs))

    def build() -> torch.nn.Module:
        ctor = copy.deepcopy(module_input.constructor_input)
        torch.manual_seed(0)
        m = info.module_cls(*ctor.args, **ctor.kwargs).to(DTYPES[dtype])
        return m.train(training)

    local_module, local = build(), map_tensors(clone, parts)
    try:
        torch.manual_seed(SEED)
        expected = step(local_module, local)
    except Exception as e:
        return both_reject(e, lambda: fetched(run_remote(grid, build, parts, traced)[0]))
    got = fetched(run_remote(grid, build, parts, traced)[0])
    exact = [compare(g, e, where, info) for where, g, e in zip(RESULTS, got, expected)]
    return "exact" if all(exact) else "close"


# What `step` returns, in order, as the failure messages name them.
RESULTS = ("output", "parameter gradients", "input gradients", "parameters after",
           "buffers after", "inputs after")  # fmt: skip


def step(module: torch.nn.Module, parts: tuple) -> tuple:
    """Forward, then backward of the summed floating-point outputs; what to compare."""
    args, kwargs = parts
    out = module(*args, **kwargs)
    summed = [t.sum() for t in tensors_in(out) if t.requires_grad and t.is_floating_point()]
    if summed:
        torch.stack(summed).sum().backward()
    leaves = [t for t in tensors_in(parts) if t.requires_grad]
    return (
        out,
        {name: p.grad for name, p in module.named_parameters()},
        [t.grad for t in leaves],
        dict(module.named_parameters()),
        dict(module.named_buffers()),
        parts,
    )


def run_remote(grid: gg.Grid, build, parts: tuple, traced: bool) -> tuple:
    """`step` with the module on w0 and the inputs spread over w0 and w1."""
    module = build()
    remote = spread(grid, parts)
    try:
        gg.send(module, grid.workers[0])
    except Exception as e:
        raise SampleFailure("error", f"sending the module: {describe(e)}", summary(e)) from e
    torch.manual_seed(SEED)
    grid.manual_seed(SEED)

    def run():
        if not traced:
            return step(module, remote)
        with gg.trace():
            return step(module, remote)

    return at_call(run), remote
