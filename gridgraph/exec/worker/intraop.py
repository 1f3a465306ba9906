"""How many intra-op threads torch may use for each op a worker thread runs.

State: torch's own setting, which is per thread, and `_THREAD.default`: what the thread
found before it first changed it. Policy: an op whose work (as `limits.op_footprint` counts
it: elements touched, multiply-adds of a product) is under `SMALL_WORK` runs on one thread;
any other op runs on the thread's default. Ops whose thread count cannot matter at their
size (`threads_matter_from`: views, and pointwise ops under ATen's grain size, which run
inline) leave the setting as it is, so a big step's few small ops cost no switching. The
choice depends on the op and its shapes only, so a program repeats bit for bit, run after
run (kernels such as convolutions round differently on another number of threads).

`torch.set_num_threads` also stores the value that threads not yet started take up. Right
after setting one thread, a short-lived thread puts that value back (about 0.1 ms, paid only
when a thread goes from a big op to a small one), so the user's later threads, and other
workers' threads, keep their default. A thread that first uses torch within that 0.1 ms may
still take up one thread.
"""

from __future__ import annotations

import math
import threading

import torch

# Under this much work an op is too small to gain from a second thread: a product of
# 32x64 by 64x64 is 1.3e5 multiply-adds, a few microseconds on one core.
SMALL_WORK = 2e5
# ATen runs a pointwise op on fewer elements than this inline, on the calling thread
# (at::internal::GRAIN_SIZE).
GRAIN_SIZE = 32768

_THREAD = threading.local()


def threads_matter_from(op: torch._ops.OpOverload) -> float:
    """The least work at which `op`'s result or speed can depend on the intra-op threads:
    never for a view (it computes nothing), GRAIN_SIZE for a pointwise op (run inline below
    it), and any work for the rest (MKL and oneDNN kernels use every thread at any size)."""
    schema = op._schema
    if torch.Tag.inplace_view in op.tags or (
        schema.returns
        and all(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)
    ):
        return math.inf
    return GRAIN_SIZE if torch.Tag.pointwise in op.tags else 0.0


def use_threads_for(work: float, matters_from: float) -> None:
    """Let torch use one intra-op thread here for an op of `work` if that is small, else this
    thread's default; leave the setting as it is if the op's `threads_matter_from` is over
    `work`.

    Why: each thread that runs an OpenMP region keeps a team of helper threads; once a
    process holds more OpenMP threads than cores, libgomp puts idle helpers to sleep at
    once, so each small product on every thread (the user's too) pays to wake its helper.
    Small ops on one thread add no team (bench/bench_threads.py shows the cost)."""
    if work < matters_from:
        return
    default = getattr(_THREAD, "default", None)
    if default is None:
        default = _THREAD.default = torch.get_num_threads()
    want = 1 if work < SMALL_WORK else default
    if torch.get_num_threads() != want:
        torch.set_num_threads(want)
        if want != default:  # put back what threads started later take up
            restore = threading.Thread(target=torch.set_num_threads, args=(default,))
            restore.start()
            restore.join()
