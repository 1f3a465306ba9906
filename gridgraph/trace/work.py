"""The arithmetic of an op from its tensors' shapes: multiply-adds of products and convolutions.

Two estimates of an op's work are built on these counts, each with a policy of its own:
placement's FLOPs (`schedule/cost.estimate_flops`, from a recorded node's metadata: what a
placement expects an op to take) and a worker's bound on the time a request takes
(`exec/safety/limits.op_work`, from meta tensors: conservative, since it refuses programs;
a worker's choice of intra-op threads, `exec/worker/intraop.py`, reads the same number).
Both take shapes as tuples of ints (a `torch.Size` is one), so neither needs the other's
kind of tensor description.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

Shape = Sequence[int]

# Products that add a matrix to their result: their operands are (input, left, right).
_ADD_PRODUCTS = frozenset({"aten::addmm", "aten::baddbmm", "aten::addbmm"})


def inner_dim(name: str, operands: Sequence[Shape]) -> int:
    """The length a matrix product `name` (its schema name, `aten::mm`) sums over, from its
    tensor operands' shapes in argument order: K of an (M x K) by (K x N) product.

    `linear`'s input's last dimension; otherwise the right operand's rows (its length where
    it is a vector; 1 where it is a number)."""
    if name == "aten::linear":
        return operands[0][-1] if len(operands[0]) else 1
    right = operands[-1]
    if name in _ADD_PRODUCTS and len(operands) >= 3:
        return right[-2] if len(right) >= 2 else 1
    if len(right) >= 2:
        return right[-2]
    return right[0] if len(right) else 1


def convolution_macs(input: Shape, weight: Shape, output: Shape, transposed: bool) -> int:
    """Multiply-adds of a convolution: every kernel element at every position, per sample.
    (Positions: the output's; a transposed convolution's are its input's.) 0 for a weight
    of fewer than 3 dimensions (no convolution takes one)."""
    if len(weight) < 3:
        return 0
    spatial = len(weight) - 2
    samples = input[0] if len(input) == len(weight) else 1
    over = input if transposed else output
    return samples * math.prod(over[-spatial:]) * math.prod(weight)
