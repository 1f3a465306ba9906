"""Checks the client makes as it records and before it sends, each raising an error that
says what to do, and the one hint it gives: a local parameter mixed with pointers (a model
sent in part), a transfer larger than its receiver reads, many ops run outside gg.trace().

State: none. Policy: a check refuses before anything is recorded or sent, naming the user's
parameter (`2.weight`), value or line; the hint is a warning, once, at the user's line.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import torch

from gridgraph.errors import GridError, GridHint
from gridgraph.schedule.plan import Plan
from gridgraph.schedule.program import Recv
from gridgraph.trace.graph import Graph, Node
from gridgraph.trace.pointer import RemoteTensor


def check_transfers(
    plan: Plan, slots: list[int], graph: Graph, message_limit: Callable[[str], int | None]
) -> None:
    """Refuse, before anything runs, a plan whose transfer to a worker is larger than
    the messages that worker reads: it would drop it unread while the run waits."""
    for worker, stages in plan.programs.items():
        limit = message_limit(worker)
        if limit is None:
            continue
        for step in (s for stage in stages for s in stage if isinstance(s, Recv)):
            values = [graph.values.get(slots[i]) for i in step.slots]
            sizes = [0 if v is None else math.prod(v.meta.shape) * v.meta.dtype.itemsize
                     for v in values]  # fmt: skip
            size = sum(sizes)
            if size > limit:
                big = step.slots[sizes.index(max(sizes))]
                raise GridError(
                    f"this run moves {size / 2**20:.1f} MiB from {step.worker!r} to "
                    f"{worker!r} in one message, over the {limit / 2**20:.1f} MiB "
                    f"{worker!r} reads ({graph.label(slots[big])} is the largest); keep the ops "
                    f"that read it on {step.worker!r} (with gg.on(...))"
                )


def hint_trace(node: Node, after: int) -> None:
    """Say once, at the user's line, that many ops ran one round trip each."""
    where = node.meta.get("where", "<unknown>:0")
    filename, _, line = where.rpartition(":")
    warnings.warn_explicit(
        f"{after} ops on pointers ran one at a time, one round trip each (outside "
        "gg.trace()); record a step in `with gg.trace():` (or gg.compile it) to run it as "
        "one batch per worker: in the README's MLP, 100 ms a step instead of 587",
        GridHint,
        filename or where,
        int(line) if line.isdigit() else 0,
    )


def check_no_local_parameter(node: Node) -> None:
    """Refuse an op that mixes a local `nn.Parameter` requiring grad with pointers (a model
    sent in part): its gradient would be a pointer, and the optimizer's step would fail far
    from here. Names the parameter as its model names it (`2.weight`)."""
    for arg in (*node.args, *node.kwargs.values()):
        for const in arg if isinstance(arg, list) else (arg,):
            source = getattr(const, "source", None)
            if isinstance(source, torch.nn.Parameter) and source.requires_grad:
                raise GridError(
                    f"{_unsent(source)} still local, and {node.name} at "
                    f"{node.meta.get('where', '<unknown>')} mixes one with pointers (its "
                    "gradient would be remote, and the optimizer's step would fail): send "
                    "them too (model.send(worker) sends every parameter of a model)"
                )


def _unsent(param: torch.nn.Parameter) -> str:
    """`parameters 2.weight, 2.bias of your Sequential are`: the local parameters of the
    outermost module holding `param`, by their dotted names, found through the garbage
    collector's referrers (on the error path only)."""
    import gc

    def holder(child: object, table: str) -> tuple[torch.nn.Module, str] | None:
        for d in gc.get_referrers(child):  # the module's table, then the module's __dict__
            if not isinstance(d, dict):
                continue
            for up in gc.get_referrers(d):
                for m in (up, *gc.get_referrers(up)) if isinstance(up, dict) else (up,):
                    if isinstance(m, torch.nn.Module) and vars(m).get(table) is d:
                        return m, next(k for k, v in d.items() if v is child)
        return None

    found = holder(param, "_parameters")
    if found is None:
        return f"parameter of shape {tuple(param.shape)} is"
    top, seen = found[0], {id(found[0])}
    while (up := holder(top, "_modules")) is not None and id(up[0]) not in seen:
        top, seen = up[0], seen | {id(up[0])}
    local = [n for n, p in top.named_parameters() if not isinstance(p, RemoteTensor)]
    if len(local) == 1:
        return f"parameter {local[0]} of your {type(top).__name__} is"
    return f"parameters {', '.join(local)} of your {type(top).__name__} are"
