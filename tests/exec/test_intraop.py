"""Small programs on an in-process worker add no OpenMP team, and leave torch's settings."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from gridgraph.exec.intraop import SMALL_WORK, use_threads_for


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
        use_threads_for(SMALL_WORK / 10)
        small = torch.get_num_threads()
        later = on_new_thread(torch.get_num_threads)
        use_threads_for(SMALL_WORK * 10)
        return small, later, torch.get_num_threads()

    small, later, big = on_new_thread(small_then_big)
    assert (small, later, big) == (1, default, default)
    assert torch.get_num_threads() == default  # the caller's own thread is untouched


SCRIPT = textwrap.dedent(
    """
    import os, threading, torch, gridgraph as gg
    def native_threads():  # OS threads that are not Python threads: OpenMP helpers
        return len(os.listdir("/proc/self/task")) - threading.active_count()
    a = torch.randn(256, 256)
    a @ a  # the user's own thread holds its OpenMP team, as any torch program's does
    before = native_threads()
    with gg.local_grid(1) as grid:
        x, w = torch.randn(32, 13).send(grid.workers[0]), torch.randn(13, 64).send(grid.workers[0])
        for _ in range(5):
            with gg.trace():
                y = x @ w
            assert torch.equal(y.get(), x.get() @ w.get())
        print(native_threads() - before)
    """
)


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="one intra-op thread: no OpenMP team")
def test_a_small_program_on_a_local_worker_starts_no_openmp_helpers():
    added = subprocess.check_output([sys.executable, "-c", SCRIPT], text=True, timeout=120)
    assert int(added.strip()) == 0
