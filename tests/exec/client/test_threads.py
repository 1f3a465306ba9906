"""One client shared by threads: one records while another runs."""

from __future__ import annotations

import sys
import threading

import torch

import gridgraph as gg


def test_a_thread_recording_while_another_runs_breaks_neither():
    # A run listed what pending work still reads by iterating the pending graph, which
    # another thread's recording grew meanwhile: "dictionary changed size during iteration"
    # (1 of bench/bench_load.py's 800 computations; 26 of these 30 runs).
    with gg.local_grid(2) as grid:
        x = torch.ones(4).send(grid.workers[0])
        stop = threading.Event()

        def record() -> None:
            while not stop.is_set():
                with gg.trace():
                    pending = [x + 1 for _ in range(20)]  # noqa: F841 (recorded, not run)

        recorder = threading.Thread(target=record)
        switch = sys.getswitchinterval()
        sys.setswitchinterval(1e-5)  # (threads take turns often: the race shows at once)
        recorder.start()
        try:
            for _ in range(30):
                with gg.trace():
                    y = x * 2
                assert torch.equal(y.get(), torch.full((4,), 2.0))
        finally:
            stop.set()
            recorder.join()
            sys.setswitchinterval(switch)
