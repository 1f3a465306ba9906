"""What the user called what they send: the names `gg.explain`, pictures and errors show.

No state. At a send we look at the user's own line of code (the first frame outside gridgraph
and torch) once, and only where it is plain enough to read without guessing:

- `x = torch.randn(8, 4).send(w0)` (one send on the line, one name assigned, the send not
  inside another call or brackets): `x`;
- else a local variable bound to the very tensor sent (`X.send(w0)`): `X`;
- a module's parameter names (`named_parameters`) get the prefix of what the line sends:
  `features.send(w0)` gives `features.0.weight`, `model[2].send(w1)` `model[2].weight`,
  so that two models sent apart never share a name.

Anything else has no name here, and is called by the op and line that made it.
"""

from __future__ import annotations

import linecache
import re
import sys
from types import FrameType
from typing import Any

from gridgraph.trace.record import in_library

_ASSIGNED = re.compile(r"^\s*([A-Za-z_]\w*)\s*(?::[^=]+)?=(?!=)")
# What `.send(` is called on: a name followed by attributes and subscripts (`model[0].fc`).
_RECEIVER = re.compile(r"([A-Za-z_]\w*(?:\.\w+|\[[^\[\]]*\])*)\.send\(")
_FUNCTION_FORM = re.compile(r"\bsend\(\s*([A-Za-z_]\w*(?:\.\w+|\[[^\[\]]*\])*)\s*,")


def _user_frame() -> FrameType | None:
    f: FrameType | None = sys._getframe(1)
    while f is not None and in_library(f.f_code.co_filename):
        f = f.f_back
    return f


def _line(frame: FrameType) -> str:
    return linecache.getline(frame.f_code.co_filename, frame.f_lineno)


def _one_send(line: str) -> bool:
    return line.count("send(") == 1


def _outermost(before: str) -> bool:
    """Whether a send whose line reads `before` between `=` and it is not inside another
    call, list or other brackets (`x = f(t.send(w))` names what f returns, not the send)."""
    return all(before.count(o) == before.count(c) for o, c in ("()", "[]", "{}"))


def tensor_name(tensor: Any) -> str | None:
    """The name the user's line gives the tensor it sends, if it is plain to see.

    >>> x = torch.randn(8, 4).send(w0)      # tensor_name(...) == "x"
    """
    frame = _user_frame()
    if frame is None:
        return None
    line = _line(frame)
    assigned = _ASSIGNED.match(line)
    if assigned and _one_send(line) and _outermost(line[assigned.end() : line.find("send(")]):
        return assigned.group(1)
    for name, value in frame.f_locals.items():
        if value is tensor and not name.startswith("_"):
            return name
    return None


def module_prefix() -> str:
    """What the user's line sends a module as (`features`, `model[0]`, `net.encoder`): the
    prefix for its parameter names ('' where the line does not say plainly)."""
    frame = _user_frame()
    if frame is None:
        return ""
    line = _line(frame)
    if not _one_send(line):
        return ""
    found = _RECEIVER.search(line) or _FUNCTION_FORM.search(line)
    return "" if found is None else found.group(1)
