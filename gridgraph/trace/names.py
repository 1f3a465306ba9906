"""What the user called what they send: the names `gg.explain`, pictures and errors show.

State: the syntax trees of the user's source files (by file, while its text is unchanged),
and the send calls found in them (by place). At a send we look at the user's own call (the
first frame outside gridgraph and torch): the instruction that frame is at gives the call's
exact place in the source, line and column, also for a call split over several lines or two
calls on one line; the file's syntax tree then says what the call's result is assigned to:

- `x = torch.randn(8, 4).send(w0)`, `self.x = ...`: `x`, `self.x`;
- `a, b = x.send(w0), y.send(w1)`: `a` and `b`;
- `xs = [t.send(w) for t in ts]`: `xs[0]`, `xs[1]`, ...: the place of the item is the number
  `range(n)` or `enumerate` gives, or that of the loop's item in the list or tuple `ts`
  (also in `zip(ts, ...)`); where it cannot be found (a filter, two loops, a generator):
  `xs[...]`;
- a send inside another expression (`f(t.send(w))`, `t.send(w) * 2`) gives its value to
  that expression, not to the name assigned: not called by it;
- else a local variable bound to the very tensor sent (`X.send(w0)`): `X`;
- a module's parameter names (`named_parameters`) get the prefix of what the call sends:
  `features.send(w0)` gives `features.0.weight`, `model[2].send(w1)` `model[2].weight`,
  so that two models sent apart never share a name.

Optimizer state on workers (a momentum buffer, Adam's averages) is called by its parameter's
name and its key in the optimizer's state (`model.0.weight.momentum_buffer`): a hook after
every optimizer step (`torch.optim`'s global step hook, registered when this module is
imported) names what is not named yet; an optimizer of local tensors is left at once.

Anything else has no name here, and is called by the op and line that made it.
"""

from __future__ import annotations

import ast
import itertools
import linecache
import sys
from types import FrameType
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from gridgraph.trace.pointer import RemoteTensor
from gridgraph.trace.record import in_library

_MAX_NAME = 80  # longer assignment targets are not names anyone reads
_trees: dict[str, tuple[str, dict[tuple, list[ast.AST]]]] = {}  # file -> (text, call paths)


def _user_frame() -> FrameType | None:
    f: FrameType | None = sys._getframe(1)
    while f is not None and in_library(f.f_code.co_filename):
        f = f.f_back
    return f


def _call_path(frame: FrameType) -> list[ast.AST] | None:
    """The send `frame` is making, then the nodes around it up to its statement (innermost
    first); None where the source cannot be read or the place is not a send in it."""
    code = frame.f_code
    where = next(itertools.islice(code.co_positions(), frame.f_lasti // 2, None), None)
    if where is None or None in where:
        return None
    line, end_line, col, end_col = where
    filename = code.co_filename
    text = "".join(linecache.getlines(filename, frame.f_globals))
    known = _trees.get(filename)
    if known is None or known[0] != text:
        known = _trees[filename] = (text, _send_calls(text))
    return known[1].get((line, col, end_line, end_col))


def _send_calls(text: str) -> dict[tuple, list[ast.AST]]:
    """Each send in `text` by its place, with the nodes around it up to its statement."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return {}
    calls: dict[tuple, list[ast.AST]] = {}
    stack: list[tuple[ast.AST, list[ast.AST]]] = [(tree, [])]
    while stack:
        node, above = stack.pop()
        if isinstance(node, ast.stmt):
            above = []
        path = [node, *above]
        if isinstance(node, ast.Call) and _is_send(node):
            end = (node.end_lineno, node.end_col_offset)
            calls.setdefault((node.lineno, node.col_offset, *end), path)
            func = node.func  # a method call's place may start at its name (`x\n.send(w)`)
            if isinstance(func, ast.Attribute):
                at = (func.end_lineno, func.end_col_offset - len(func.attr))
                calls.setdefault((*at, *end), path)
        stack.extend((child, path) for child in ast.iter_child_nodes(node))
    return calls


def _is_send(call: ast.Call) -> bool:
    """`x.send(w)`, `gg.send(x, w)` or `send(x, w)`."""
    func = call.func
    return (
        isinstance(func, ast.Attribute)
        and func.attr == "send"
        or (isinstance(func, ast.Name) and func.id == "send")
    )


def _target(node: ast.AST) -> str | None:
    """The text of an assignment target that is a name (`x`, `self.x`, `d["k"]`)."""
    if isinstance(node, ast.Name | ast.Attribute | ast.Subscript):
        text = ast.unparse(node)
        return text if len(text) <= _MAX_NAME else None
    return None


def _assigned(path: list[ast.AST], frame: FrameType) -> str | None:
    """The name the statement gives the value of the call `path[0]`, if it gives it one."""
    node, above = path[0], path[1:]
    item = None  # the place in a list comprehension's result
    if above and isinstance(above[0], ast.ListComp) and above[0].elt is node:
        node, above, item = above[0], above[1:], _item(above[0], frame)
    if not above or not isinstance(above[0], ast.Assign | ast.AnnAssign | ast.Tuple):
        return None
    if isinstance(above[0], ast.Tuple):  # `a, b = x.send(w), y.send(w)`
        values, statement = above[0], above[1] if len(above) > 1 else None
        if not isinstance(statement, ast.Assign) or statement.value is not values:
            return None
        [targets] = statement.targets if len(statement.targets) == 1 else [None]
        if not isinstance(targets, ast.Tuple | ast.List) or len(targets.elts) != len(values.elts):
            return None
        name = _target(targets.elts[values.elts.index(node)])
    else:
        statement = above[0]
        targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
        if statement.value is not node or len(targets) != 1:
            return None
        name = _target(targets[0])
    if name is None or item is None:
        return name
    return f"{name}[{item}]"


def _item(comprehension: ast.ListComp, frame: FrameType) -> str:
    """Which item of its result a list comprehension is making: its number, or '...'."""
    if len(comprehension.generators) != 1 or comprehension.generators[0].ifs:
        return "..."
    loop = comprehension.generators[0]
    source, target = loop.iter, loop.target
    func = source.func if isinstance(source, ast.Call) else None
    called = func.id if isinstance(func, ast.Name) else None
    if called in ("range", "enumerate") and len(source.args) == 1 and not source.keywords:
        number = _value(target if called == "range" else _first(target), frame)
        return str(number) if type(number) is int else "..."
    if called == "zip" and source.args:
        source, target = source.args[0], _first(target)
    sequence, item = _value(source, frame), _value(target, frame)
    if isinstance(sequence, list | tuple) and item is not None:
        for i, each in enumerate(sequence):
            if each is item:
                return str(i)
    return "..."


def _first(target: ast.AST) -> ast.AST | None:
    return target.elts[0] if isinstance(target, ast.Tuple) and target.elts else None


def _value(node: ast.AST | None, frame: FrameType) -> Any:
    """The value of a plain name in the comprehension running in `frame` (its own frame, or
    the one it is inlined in), in the frame around it, or in the module; None otherwise."""
    if not isinstance(node, ast.Name):
        return None
    for scope in (frame.f_locals, frame.f_back.f_locals if frame.f_back else {}):
        if node.id in scope:
            return scope[node.id]
    return frame.f_globals.get(node.id)


def tensor_name(tensor: Any) -> str | None:
    """The name the user's call gives the tensor it sends, if it is plain to see.

    >>> x = torch.randn(8, 4).send(w0)      # tensor_name(...) == "x"
    """
    frame = _user_frame()
    if frame is None:
        return None
    path = _call_path(frame)
    name = None if path is None else _assigned(path, frame)
    if name is not None:
        return name
    for local, value in frame.f_locals.items():
        if value is tensor and not local.startswith(("_", ".")):
            return local
    return None


def module_prefix() -> str:
    """What the user's call sends a module as (`features`, `model[0]`, `net.encoder`): the
    prefix for its parameter names ('' where the call does not say plainly)."""
    frame = _user_frame()
    path = None if frame is None else _call_path(frame)
    if not path:
        return ""
    call = path[0]
    if len(call.args) >= 2:  # `gg.send(model, w)`
        sent = call.args[0]
    elif isinstance(call.func, ast.Attribute):  # `model.send(w)`
        sent = call.func.value
    else:
        return ""
    plain = all(
        isinstance(n, ast.Name | ast.Attribute | ast.Subscript | ast.Constant | ast.Load)
        for n in ast.walk(sent)
    )
    return ast.unparse(sent) if plain else ""


def name_optimizer_state(optimizer: torch.optim.Optimizer, *_: Any) -> None:
    """Call the state an optimizer keeps on workers by its parameter's name and its key
    (`model.0.weight.momentum_buffer`, `fc.bias.exp_avg`), where it has no name yet."""
    if not isinstance(next(iter(optimizer.state), None), RemoteTensor):
        return  # an optimizer of local tensors (its parameters all go one way)
    for param, state in list(optimizer.state.items()):
        if not isinstance(param, RemoteTensor):
            continue
        graph = param._owner.graph
        name = graph.user_name(param._vid)
        if name is None:
            continue
        for key, value in state.items():
            same_grid = isinstance(value, RemoteTensor) and value._owner is param._owner
            if same_grid and graph.user_name(value._vid) is None:
                graph.name(value._vid, f"{name}.{key}", state=True)


register_optimizer_step_post_hook(name_optimizer_state)
