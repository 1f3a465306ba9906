"""What gridgraph refuses by design: the one list of OpInfo entries it does not support.

Each entry names an OpInfo entry (`name` or `name.variant`, as the conformance table prints
it) and says why. Such an op must raise `gg.GridError` (`gg.RecordError` is one) at the call
for the samples it refuses; the suite checks that, and that its other samples give what torch
gives. Anything not listed here that fails is a bug, not a design limit.
"""

from __future__ import annotations

import gridgraph as gg

REFUSAL_ERRORS = (gg.GridError,)

_SPARSE = "pointers, workers and the wire hold dense (strided) tensors only"
_DTYPE = "which the wire does not carry (gridgraph.exec.wire.DTYPES; README, Ops)"

REFUSED: dict[str, str] = {
    "to_sparse": f"returns a sparse COO tensor; {_SPARSE}",
    "sparse.sampled_addmm": f"takes a sparse CSR tensor; {_SPARSE}",
    "sparse.mm.reduce": f"takes a sparse CSR tensor; {_SPARSE}",
    "chalf": f"returns complex32, {_DTYPE}",
}
