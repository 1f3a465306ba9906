"""Which module call an op is recorded in: `features.0 (Conv2d)`, for pictures and `explain`.

State: per thread, the stack of the calls of sent modules whose `forward` is running, each
(label, call number, whether the module holds parameters or buffers), and a count of calls
(one box per call, not per module); for all threads, how many such calls are running. A
module sent with `model.send(w)` gets a forward pre-hook and hook on itself and each
submodule (once; sending again relabels). Recording reads the innermost label (`locate`).
The backward pass runs no module code, so when a module's forward returns, the hook labels
the autograd nodes it made (from its outputs back to its inputs) in their `metadata`;
recording in backward reads the label of the autograd node torch is running, with
" backward" added.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

_state = threading.local()
_KEY = "gridgraph"  # the key of our label in an autograd node's metadata
_current_autograd_node = torch._C._current_autograd_node
_running = [0]  # calls of sent modules running now, on any thread
_running_lock = threading.Lock()


def locate() -> tuple[tuple[str, int, bool] | None, Any]:
    """Where an op recorded now is: (label, call number, whether the module holds tensors
    of its own) of the innermost sent module running, or of the module call whose backward
    this is, else None; and in backward, the leaf whose gradient torch is accumulating (an
    `AccumulateGrad` node's variable), else None. One look at torch's autograd state."""
    if _running[0]:  # (a thread-local read costs more than the rest: skip it when none)
        stack = _state.__dict__.get("stack")
        if stack:
            return stack[-1], None
    node = _current_autograd_node()
    if node is None:
        return None, None
    label = node.metadata.get(_KEY)
    if label is not None:
        return (label[0] + " backward", *label[1:]), None
    return None, getattr(node, "variable", None)


def label_module(module: torch.nn.Module, prefix: str = "") -> None:
    """Hook `module` and its submodules so ops recorded in their forward (and backward)
    carry `prefix.qualified.name (Class)`.

    >>> label_module(model)          # ops in model[0].forward: "0 (Linear)"
    """
    for qualname, m in module.named_modules():
        name = ".".join(p for p in (prefix, qualname) if p)
        label = f"{name} ({type(m).__name__})" if name else type(m).__name__
        if getattr(m, "_gg_scope", None) is None:
            m.register_forward_pre_hook(_enter)
            # (run however forward ends; its keyword inputs bound the autograd walk too)
            m.register_forward_hook(_leave, with_kwargs=True, always_call=True)
        m._gg_scope = label
        m._gg_owns = any(t is not None for t in (*m._parameters.values(), *m._buffers.values()))


def _enter(module: torch.nn.Module, args: Any) -> None:
    state = _state.__dict__
    state["calls"] = calls = state.get("calls", 0) + 1
    state.setdefault("stack", []).append((module._gg_scope, calls, module._gg_owns))
    with _running_lock:
        _running[0] += 1


def _leave(module: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> None:
    stack = _state.__dict__.get("stack")
    label = stack.pop() if stack else (module._gg_scope, 0, module._gg_owns)
    with _running_lock:
        _running[0] = max(0, _running[0] - 1)
    inputs = {t.grad_fn for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
    todo = [t.grad_fn for t in tree_leaves(output) if isinstance(t, torch.Tensor)]
    seen: set = set()
    while todo:  # the autograd nodes this call made: from its outputs back to its inputs
        node = todo.pop()
        if node is None or node in inputs or node in seen:
            continue
        seen.add(node)
        if not hasattr(node, "variable"):  # not a leaf's AccumulateGrad
            node.metadata.setdefault(_KEY, label)  # an inner module's label stays
            todo.extend(n for n, _ in node.next_functions)
