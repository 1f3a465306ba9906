"""List the ATen overloads that reach `__torch_dispatch__` when PyTorch's own OpInfo samples run.

These are the ops gridgraph records (it sits at the same level as a TorchDispatchMode), so
this is the raw material of the op allowlist (gridgraph/trace/allowlist.py), which is then
reviewed and categorised by hand. Run on CPU, forward and backward, for float32, float64,
int64, bool, complex64 and bfloat16; prints a JSON map from overload name to the OpInfos
that reached it (and their in-place variants):

    python scripts/collect_dispatch_ops.py > /tmp/dispatch_ops.json
"""

from __future__ import annotations

import json
import sys
import warnings

import torch
from torch.testing._internal.common_methods_invocations import op_db
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

DTYPES = (torch.float32, torch.float64, torch.int64, torch.bool, torch.complex64, torch.bfloat16)


class Log(TorchDispatchMode):
    def __init__(self, seen: dict[str, set[str]], opinfo: str) -> None:
        super().__init__()
        self.seen, self.opinfo = seen, opinfo

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.setdefault(func.name(), set()).add(self.opinfo)
        return func(*args, **(kwargs or {}))


def run_inplace(opinfo, sample) -> None:
    detach = lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t  # noqa: E731
    with torch.no_grad():
        opinfo.inplace_variant(detach(sample.input), *sample.args, **sample.kwargs)


def run_sample(opinfo, sample, backward: bool) -> None:
    out = opinfo(sample.input, *sample.args, **sample.kwargs)
    if not backward:
        return
    grads = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
    if grads:
        torch.autograd.backward([g.abs().sum() if g.is_complex() else g.sum() for g in grads])


def main() -> None:
    warnings.simplefilter("ignore")
    seen: dict[str, set[str]] = {}
    for i, opinfo in enumerate(op_db):
        name = opinfo.name + (f".{opinfo.variant_test_name}" if opinfo.variant_test_name else "")
        print(f"{i}/{len(op_db)} {name}", file=sys.stderr, flush=True)
        supported = opinfo.supported_dtypes("cpu")
        for dtype in DTYPES:
            if dtype not in supported:
                continue
            grad = opinfo.supports_autograd and (dtype.is_floating_point or dtype.is_complex)
            try:
                samples = list(opinfo.sample_inputs("cpu", dtype, requires_grad=grad))
            except Exception:
                continue
            for sample in samples:
                try:
                    with Log(seen, name):
                        run_sample(opinfo, sample, grad)
                except Exception:
                    pass
                if opinfo.inplace_variant is None:
                    continue
                try:
                    with Log(seen, name + " (in place)"):
                        run_inplace(opinfo, sample)
                except Exception:
                    pass
    json.dump({k: sorted(v) for k, v in sorted(seen.items())}, sys.stdout, indent=0)


if __name__ == "__main__":
    main()
