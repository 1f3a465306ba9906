"""The executors' forkserver: what it preloads stays out of the collector's sight."""

from __future__ import annotations

import subprocess
import sys


def test_the_forkserver_keeps_what_it_preloaded_out_of_the_collectors_sight():
    # In a process of its own, as the forkserver is: freezing is for the whole process.
    code = "import gc, gridgraph.exec.isolation.preload; print(gc.get_freeze_count())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(out.stdout) > 100_000  # torch's modules and functions, not a handful
