"""Small programs on an in-process worker add no OpenMP team, and leave torch's settings."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from gridgraph.exec.worker.intraop import (
    GRAIN_SIZE,
    SMALL_WORK,
    threads_matter_from,
    use_threads_for,
)


def on_new_thread(fn):
    """fn()'s result, run on a thread started now."""
    out = []
    thread = threading.Thread(target=lambda: out.append(fn()))
    thread.start()
    thread.join()
    return out[0]


def test_small_work_runs_on_one_thread_and_later_threads_keep_the_default():
    default = on_new_thread(torch.get_num_threads)

    def small_then_big():
        use_threads_for(SMALL_WORK / 10, 0)
        small = torch.get_num_threads()
        later = on_new_thread(torch.get_num_threads)
        use_threads_for(SMALL_WORK * 10, math.inf)  # e.g. a view: the setting stays
        kept = torch.get_num_threads()
        use_threads_for(SMALL_WORK * 10, 0)
        return small, later, kept, torch.get_num_threads()

    small, later, kept, big = on_new_thread(small_then_big)
    assert (small, later, kept, big) == (1, default, 1, default)
    assert torch.get_num_threads() == default  # the caller's own thread is untouched


SCRIPT = textwrap.dedent(
    """
    import os, sys, threading, torch, gridgraph as gg
    def native_threads():  # OS threads that are not Python threads: OpenMP helpers
        return len(os.listdir("/proc/self/task")) - threading.active_count()
    a = torch.randn(256, 256)
    a @ a  # the user's own thread holds its OpenMP team, as any torch program's does
    before = native_threads()
    n = int(sys.argv[1])
    with gg.local_grid(1) as grid:
        x, w = torch.randn(n, n).send(grid.workers[0]), torch.randn(n, n).send(grid.workers[0])
        for _ in range(5):
            with gg.trace():
                y = x @ w
            torch.testing.assert_close(y.get(), x.get() @ w.get())
        print(native_threads() - before, flush=True)
    os._exit(0)  # the count is out; interpreter teardown is not under test here
    """
)


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="one intra-op thread: no OpenMP team")
@pytest.mark.parametrize(("side", "team"), [(32, False), (512, True)], ids=["small", "big"])
def test_only_a_big_op_on_a_local_worker_starts_openmp_helpers(side, team):
    # 32x32 @ 32x32 is 6.6e4 multiply-adds, under SMALL_WORK; 512x512 @ 512x512 is 2.7e8
    added = subprocess.check_output(
        [sys.executable, "-c", SCRIPT, str(side)], text=True, timeout=120
    )
    assert (int(added.strip()) > 0) == team


def test_views_and_small_pointwise_ops_need_no_switch():
    # A big step's few small ops (a view of the logits, a bias update) switched a worker's
    # thread down and up again each step; these run the same on any number of threads.
    aten = torch.ops.aten
    assert threads_matter_from(aten.view.default) == math.inf
    assert threads_matter_from(aten.transpose_.default) == math.inf  # an in-place view
    assert threads_matter_from(aten.add_.Tensor) == GRAIN_SIZE  # pointwise: inline below it
    assert threads_matter_from(aten.mm.default) == 0  # MKL: every thread, at any size
    assert threads_matter_from(aten._log_softmax.default) == 0
