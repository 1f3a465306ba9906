"""What a worker charges an op before it runs, next to what the op then takes.

Run: python bench/bench_charges.py [--only SUBSTRING]

A worker refuses a program before it runs from its charges (gridgraph/exec/safety/limits.py): the
bytes each op makes and its scratch (`op_footprint`, or `data_dependent_footprint`), and its
work, which a time limit divides by WORK_PER_SECOND. This runs each case below in a child
process of its own (one intra-op thread, its address space capped at 8 GiB), charges it
as the worker does (`CompiledCall.footprint`), runs it as a worker does (`CompiledCall.run`,
its kernel checks included), and prints side by side:
  - the charged bytes and the peak growth of the child's resident memory (a ratio over 1
    means the op took more than it was charged: a limit it can slip past);
  - the charged time (work / WORK_PER_SECOND) and the measured time. WORK_PER_SECOND is
    generous on purpose (only a program clearly over the limit is refused before it runs;
    the rest are stopped when they overrun), so the first case, a plain add, gives the
    ratio every other case's is to be read against.
The cases are the kinds of op whose charges needed work of their own: convolutions and the
kernel torch picks for them, pools' windows, per-row counts, per-index calls, sorts.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch

# label -> (op, Python expression building its arguments (args, kwargs), with torch as t)
CASES = {
    "add (the reference ratio)": ("aten::add.Tensor", "[t.rand(10**7), t.rand(10**7)], {}"),
    "mm 1024": ("aten::mm", "[t.rand(1024, 1024), t.rand(1024, 1024)], {}"),
    "conv2d float32, 1 channel (oneDNN pads to 16)": (
        "aten::convolution",
        "[t.rand(1, 1, 2048, 2048), t.rand(1, 1, 3, 3), None, [1, 1], [1, 1], [1, 1], False,"
        " [0, 0], 1], {}",
    ),
    "conv3d float32, 1 channel (unfolds columns)": (
        "aten::convolution",
        "[t.rand(1, 1, 96, 96, 96), t.rand(4, 1, 3, 3, 3), None, [1] * 3, [1] * 3, [1] * 3,"
        " False, [0] * 3, 1], {}",
    ),
    "conv2d float64 (unfolds columns)": (
        "aten::convolution",
        "[t.rand(1, 16, 256, 256, dtype=t.float64), t.rand(16, 16, 5, 5, dtype=t.float64),"
        " None, [1, 1], [2, 2], [1, 1], False, [0, 0], 1], {}",
    ),
    "avg_pool2d, kernel_size [48] (48 x 48)": (
        "aten::avg_pool2d",
        "[t.rand(1, 1, 1024, 1024), [48], [1]], {}",
    ),
    "adaptive_avg_pool3d 256^3 -> 150^3": (
        "aten::_adaptive_avg_pool3d",
        "[t.rand(1, 1, 256, 256, 256), [150, 150, 150]], {}",
    ),
    "embedding_renorm_, 10^5 indices": (
        "aten::embedding_renorm_",
        "[t.rand(10**5, 4), t.randperm(10**5), 1.0, 2.0], {}",
    ),
    "_embedding_bag_backward, 2^24 rows of one column": (
        "aten::_embedding_bag_backward",
        "[t.rand(1, 1), t.zeros(1, dtype=t.long), t.zeros(1, dtype=t.long),"
        " t.zeros(1, dtype=t.long), t.ones(1, dtype=t.long), t.empty(0, dtype=t.long),"
        " 1 << 24, False, 0, False, None, -1], {}",
    ),
    "sort 10^7": ("aten::sort", "[t.rand(10**7)], {}"),
    "_pdist_backward, 1000 points of 16": (
        "aten::_pdist_backward",
        "[t.rand(499500), t.rand(1000, 16), 2.0, t.rand(499500)], {}",
    ),
    "searchsorted 10^7 in 10^7": (
        "aten::searchsorted.Tensor",
        "[t.arange(1e7), t.rand(10**7)], {}",
    ),
    "nonzero 10^7 (data-dependent)": ("aten::nonzero", "[t.rand(10**7) > 0.5], {}"),
}


def measure(label: str) -> dict:
    """In this (child) process: charge the case as a worker does, then run it."""
    from gridgraph.exec.safety.limits import WORK_PER_SECOND, data_dependent_footprint
    from gridgraph.exec.worker.ops import RandomState
    from gridgraph.exec.worker.prepare import CompiledCall
    from gridgraph.schedule.program import Call

    cap = 8 << 30
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    torch.set_num_threads(1)
    name, build = CASES[label]
    args, kwargs = eval(build, {"t": torch})  # (the expressions above, nothing else)
    call = CompiledCall(Call(name, args, kwargs, [0], [], False))
    charged = call.footprint(args, kwargs) or data_dependent_footprint(call.op, args, kwargs)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.perf_counter()
    call.run(RandomState(), args, kwargs)  # as a worker runs it: its kernel checks first
    seconds = time.perf_counter() - start
    grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    return {"bytes": charged[0], "grew": grew, "charged_s": charged[1] / WORK_PER_SECOND,
            "seconds": seconds}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="run the cases whose label has this")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.child:
        print(json.dumps(measure(opts.child)))
        return
    print(f"{'case':48s} {'charged':>9s} {'took':>9s} {'ratio':>6s}   "
          f"{'charged':>9s} {'ran':>8s} {'ratio':>7s}")  # fmt: skip
    for label in CASES:
        if opts.only not in label:
            continue
        child = subprocess.run([sys.executable, __file__, "--child", label],
                               capture_output=True, text=True, timeout=300)  # fmt: skip
        if child.returncode != 0:
            print(f"{label:48s} failed: {child.stderr.strip().splitlines()[-1:]}")
            continue
        r = json.loads(child.stdout.splitlines()[-1])
        print(f"{label:48s} {r['bytes'] / 2**20:7.0f}MB {r['grew'] / 2**20:7.0f}MB "
              f"{r['grew'] / max(r['bytes'], 1):6.2f}   {r['charged_s']:8.4f}s "
              f"{r['seconds']:7.3f}s {r['seconds'] / max(r['charged_s'], 1e-9):7.0f}")  # fmt: skip


if __name__ == "__main__":
    main()
