"""Reading one op call's arguments: by their schema names, and the tensors among them.

State: each op's schema arguments, read once per op (`_schema_arguments`), since the readers
run on every call of their ops (a batch norm's check in every training step). Used by the
kernel checks (kernel_checks.py) and the memory and time bounds (limits.py), which read the
same calls.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch

Arg = Callable[..., Any]  # arg(name, default=None): a call's argument, by schema name


def argument_reader(op: torch._ops.OpOverload, args: list, kwargs: dict) -> Arg:
    """`arg(name, default=None)`: the argument of `op`'s schema called `name` in this call
    (its schema's default where the call leaves it out; `default` where it has none, or
    the schema has no such argument)."""
    schema = _schema_arguments(op)

    def arg(name: str, default: Any = None) -> Any:
        if name not in schema:
            return default
        i, argument = schema[name]
        if i < len(args):
            return args[i]
        if name in kwargs:
            return kwargs[name]
        return argument.default_value if argument.has_default_value() else default

    return arg


@functools.cache
def _schema_arguments(op: torch._ops.OpOverload) -> dict[str, tuple[int, Any]]:
    """{argument name: (position, schema argument)} of `op`."""
    return {a.name: (i, a) for i, a in enumerate(op._schema.arguments)}


def tensors_in(*values: Any) -> list[torch.Tensor]:
    """The tensors in `values`, in order, also inside lists, tuples and dicts (a call's
    keyword arguments)."""
    found: list[torch.Tensor] = []

    def walk(items: Any) -> None:
        for a in items:
            if isinstance(a, torch.Tensor):
                found.append(a)
            elif isinstance(a, (list, tuple)):
                walk(a)
            elif isinstance(a, dict):
                walk(a.values())

    walk(values)
    return found


def stored_values(t: torch.Tensor) -> torch.Tensor:
    """Every element of `t`'s storage, flat, in its dtype (a negated view's bit not applied):
    what a check reads of a tensor's values. An expanded tensor, read as its logical
    elements, would be read (or copied) billions of times; its storage is what its client
    holds, and is charged for."""
    storage = t.untyped_storage()
    return t.new_empty(0).set_(storage, 0, (storage.nbytes() // t.element_size(),))


def stored_magnitude(t: torch.Tensor) -> float:
    """The largest absolute value `t`'s storage holds (`stored_values`; inf for a NaN)."""
    stored = stored_values(t)
    if not stored.numel():
        return 0.0
    if stored.is_complex():
        most = float(stored.abs().amax())
    else:  # (no copy, as abs() would make)
        most = max(float(stored.amax()), -float(stored.amin()))
    return math.inf if math.isnan(most) else most
