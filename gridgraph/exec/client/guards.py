"""What a compiled step's replay checks: argument guards, snapshots and Python state.

A guard (`guard`) is what a recording depends on of one argument: its type; a pointer's
shape, dtype, location and grid; a local tensor's metadata; ints, bools, strings and shapes
by value; other objects by identity. `flatten` makes what lists, tuples and dicts hold
arguments of their own, and `modes` adds torch's grad mode, autocast and default dtype.

A snapshot (`snapshot`) is a float or a copy of a local tensor, compared bit for bit (`same`)
between two recordings and at each replay. `state` is the Python state a step's ops depend on
that can be seen: modules' settings, parameters, buffers, submodules and hooks, and
optimizers' hyperparameters and parameters, named by id while `referents` are `alive`.
Nothing here holds state of its own.
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch
from torch.nn.modules import module as nn_module

from gridgraph.trace.graph import Const, Node
from gridgraph.trace.meta import TensorMeta, as_sent
from gridgraph.trace.pointer import RemoteTensor


def flatten(top: list) -> list:
    """The arguments, then what the lists, tuples and dicts among them hold (outer levels
    first): a pointer, tensor or float in a container is guarded and read as an argument."""
    flat, seen = list(top), set()
    for a in flat:  # grows as it goes
        if isinstance(a, (list, tuple, dict)) and id(a) not in seen:
            seen.add(id(a))
            flat.extend(a.values() if isinstance(a, dict) else a)
    return flat


_BY_VALUE = (int, bool, str, torch.dtype, torch.device, torch.memory_format, torch.layout)


def by_identity(a: Any) -> bool:
    """Whether an argument is guarded by identity (an object of the user's)."""
    return not (
        a is None
        or isinstance(a, (torch.Tensor, list, tuple, dict))
        or type(a) in (float, complex)
        or type(a) in _BY_VALUE
    )


def guard(a: Any) -> Any:
    """What of an argument a recording depends on (its value only where it shapes the ops).
    A container's items are arguments of their own (`flatten`): here, its structure."""
    t = type(a)
    if isinstance(a, RemoteTensor):
        value = a._owner.graph.values.get(a._vid)
        where = (value.meta, value.location) if value is not None else (TensorMeta.of(a), None)
        return (t, id(a._owner), *where, a.requires_grad)
    if isinstance(a, torch.Tensor):
        return (torch.Tensor, TensorMeta.of(a), a.requires_grad)
    if t is float:
        return float
    if t is complex:  # in the plan: 0j and -0j differ
        return (t, a.real.hex(), a.imag.hex())
    if a is None or t in _BY_VALUE:
        return (t, a)
    if isinstance(a, (tuple, list)):
        return (t, len(a))
    if isinstance(a, dict):
        return (t, tuple(a))
    return (t, id(a))


def modes() -> tuple:
    """torch's modes that change what a step records: grad mode (a step with .backward()
    raises under no_grad), autocast, and the dtype of the tensors it makes."""
    return (
        torch.is_grad_enabled(),
        torch.is_inference_mode_enabled(),
        torch.is_autocast_enabled("cpu"),
        torch.get_autocast_dtype("cpu"),
        torch.get_default_dtype(),
    )


def aliases(flat: list) -> tuple[int, ...]:
    """For each pointer argument, the first argument naming the same value."""
    first: dict[int, int] = {}
    return tuple(first.setdefault(a._vid, i) for i, a in enumerate(flat)
                 if isinstance(a, RemoteTensor))  # fmt: skip


class _Snap:
    """A local tensor's value at a call (a copy): what a recording compares."""

    __slots__ = ("meta", "values")

    def __init__(self, t: torch.Tensor) -> None:
        sent = as_sent(t)
        self.meta = TensorMeta.of(sent)
        self.values = sent.clone()


def snapshot(a: Any) -> Any:
    """A float (itself) or local tensor (a copy) that may reach an op; else None."""
    if type(a) is float:
        return a
    if isinstance(a, torch.Tensor) and not isinstance(a, RemoteTensor):
        return _Snap(a)
    return None


def same(a: Any, b: Any) -> bool:
    """Bit-for-bit equality of two snapshots (floats: -0.0 is not 0.0, NaN is NaN)."""
    if type(a) is float and type(b) is float:
        if a != a or b != b:
            return a != a and b != b
        return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)
    if type(a) is _Snap and type(b) is _Snap:
        return a.meta == b.meta and torch.equal(a.values, b.values)
    return False


def scalar(snap: Any) -> float | None:
    """A snapshot as the one number an op takes for it (a float, or a one-element local
    tensor such as a tensor `lr` read with `.item()`), else None."""
    if type(snap) is float:
        return snap
    if type(snap) is _Snap and snap.values.numel() == 1 and snap.values.is_floating_point():
        return float(snap.values.reshape(()).item())
    return None


def show(snap: Any) -> str:
    """A snapshot as an error message names it."""
    if type(snap) is _Snap:
        return f"a local tensor of shape {tuple(snap.meta.shape)}"
    return repr(snap)


class _Is:
    """Equal to another `_Is` of the same live object (identity, without keeping it alive:
    a replaced parameter may be freed and its id reused)."""

    __slots__ = ("ref",)

    def __init__(self, obj: Any) -> None:
        self.ref = weakref.ref(obj)

    def __eq__(self, other: object) -> bool:
        return type(other) is _Is and (obj := self.ref()) is not None and obj is other.ref()

    __hash__ = None


def _identities(objects: Any) -> tuple:
    """The objects' ids: the same objects while `referents` of the recording are alive."""
    return tuple(map(id, objects))


def referents(watched: tuple[list, list]) -> list[weakref.ref]:
    """Weak references to every object `state` names by id. While all are alive, an equal
    id is the same object (ids are reused only once their object is freed), and none of
    them is kept alive by a recording (a replaced parameter's remote memory is freed)."""
    modules, optimizers = watched
    objects = [x for m in modules for d in (m._parameters, m._buffers, m._modules)
               for x in d.values() if x is not None]  # fmt: skip
    objects += [p for o in optimizers for g in o.param_groups for p in g["params"]]
    return [weakref.ref(x) for x in objects]


def alive(referents: list[weakref.ref]) -> bool:
    return all(r() is not None for r in referents)


_MODULE_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


def _settings(m: torch.nn.Module) -> tuple:
    """A module's plain settings: `training`, `Dropout.p`, `BatchNorm.momentum`, ... (floats
    bit for bit)."""
    return tuple(
        (k, v.hex() if type(v) is float else v)
        for k, v in vars(m).items()
        if v is None or type(v) in (bool, int, float, str)
    )


def state(watched: tuple[list, list]) -> tuple:
    """The Python state a step's ops depend on that we can see: modules' settings (train or
    eval mode, `Dropout.p`), parameters, buffers, submodules and hooks (global ones too),
    and each optimizer's hyperparameters (an LR scheduler changes `lr`) and parameters."""
    modules, optimizers = watched
    mods = tuple(
        (
            _settings(m),
            tuple(m._parameters),
            _identities(m._parameters.values()),
            tuple(m._buffers),
            _identities(m._buffers.values()),
            tuple(m._modules),
            _identities(m._modules.values()),
            *(tuple(getattr(m, hooks, ())) for hooks in _MODULE_HOOKS),
        )
        for m in modules
    )
    groups = tuple(
        tuple((k, _hyperparameter(v)) for k, v in g.items() if k != "params")
        + (_identities(g["params"]),)
        for o in optimizers
        for g in o.param_groups
    )
    hooks = tuple(tuple(getattr(nn_module, f"_global{h}")) for h in _MODULE_HOOKS)
    return mods, groups, hooks if modules else ()


def _hyperparameter(v: Any) -> Any:
    """An optimizer hyperparameter as compared between calls: a float or local tensor by
    kind only (its value is an argument of the step: `hyperparameters`), a pointer by
    identity, the rest as it is."""
    if isinstance(v, RemoteTensor):
        return _Is(v)
    if type(v) is float:
        return float
    return (torch.Tensor, TensorMeta.of(v)) if isinstance(v, torch.Tensor) else v


Hyperparameter = tuple[torch.optim.Optimizer, int, str]  # optimizer, group index, key


def hyperparameters(optimizers: list) -> list[Hyperparameter]:
    """The floats and local tensors in these optimizers' param groups (`lr`, `momentum`):
    what an LR scheduler changes between steps. A step takes their values at each call as
    arguments it did not name (a learning rate that changes every step is replayed)."""
    return [
        (o, i, k)
        for o in optimizers
        for i, g in enumerate(o.param_groups)
        for k, v in g.items()
        if k != "params"
        and (type(v) is float or (isinstance(v, torch.Tensor) and not isinstance(v, RemoteTensor)))
    ]


def hyperparameter_values(found: list[Hyperparameter]) -> list[Any]:
    """Their values now (a group that is gone reads as None: the state check fails)."""
    out = []
    for o, i, k in found:
        groups = o.param_groups
        out.append(groups[i].get(k) if i < len(groups) else None)
    return out


def autograd_state(p: RemoteTensor | None) -> tuple | None:
    """What autograd does with a pointer a step reads: whether it takes a gradient, and the
    hooks it runs on it."""
    if p is None:
        return None
    return (
        p.requires_grad,
        tuple(p._backward_hooks or ()),
        tuple(getattr(p, "_post_accumulate_grad_hooks", None) or ()),
    )


def param_sources(node: Node) -> list[torch.Tensor | None]:
    """The user's tensor behind each of a node's parameters (None for a float), in the order
    recording walked its arguments."""
    found: list[torch.Tensor | None] = []

    def walk(a: Any) -> None:
        if type(a) is Const:
            found.append(a.source)
        elif type(a) is float:
            found.append(None)
        elif isinstance(a, list):
            for x in a:
                walk(x)

    for a in (*node.args, *node.kwargs.values()):
        walk(a)
    return found if len(found) == len(node.params) else [None] * len(node.params)
