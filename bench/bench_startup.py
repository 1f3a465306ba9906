"""What a newcomer waits for before the first result: import, grid, first send and op.

Run: python bench/bench_startup.py [--work 3]

Each line is a fresh interpreter (nothing warm): `import gridgraph`, `gg.local_grid(2)`,
then a send and one op, either at once or after `--work` s of the user's own work (loading
data). The first op's meta kernel imports torch._dynamo (2-3 s idle); a grid starts that
import in the background when it is made, so with work in between the first op is quick.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

CHILD = """
import time
t0 = time.perf_counter()
import torch, gridgraph as gg
t1 = time.perf_counter()
with gg.local_grid(2) as grid:
    t2 = time.perf_counter()
    time.sleep({work})
    t3 = time.perf_counter()
    x = torch.ones(3).send(grid.workers[0])
    y = (x + 1).get()
    t4 = time.perf_counter()
print(f"{{t1 - t0:.2f}} {{t2 - t1:.2f}} {{t4 - t3:.2f}}")
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=float, default=3.0, help="seconds of the user's work")
    args = parser.parse_args()
    print(f"{'':28} import   grid   first send + op (s)")
    for label, work in (("at once", 0.0), (f"after {args.work:g} s of other work", args.work)):
        out = subprocess.run(
            [sys.executable, "-c", CHILD.format(work=work)], capture_output=True, text=True
        )
        if out.returncode:
            raise SystemExit(out.stderr)
        imported, grid, first = out.stdout.split()
        print(f"{label:28} {imported:>6} {grid:>6} {first:>8}")


if __name__ == "__main__":
    main()
