"""What the executors' forkserver imports once, so that each executor starts warm.

Importing torch takes seconds, and so does the first op on the meta device (it loads
PyTorch's meta kernels and decompositions). The forkserver does both here, once; every
executor forked from it then starts in tens of milliseconds (see executor.py).
"""

import torch

import gridgraph.exec.isolation.executor  # noqa: F401  (the executor's own code)
from gridgraph.exec.safety.limits import op_footprint

_meta = torch.empty(2, 2, device="meta")
op_footprint(torch.ops.aten.mm.default, [_meta, _meta], {})
op_footprint(torch.ops.aten.add.Tensor, [_meta, 1], {})
