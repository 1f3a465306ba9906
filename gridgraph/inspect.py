"""`gg.explain` and `gg.visualize`: see where a recorded graph would run, before it runs.

Both compile the plan that computing the target would run now (placement and split, not the
run itself) and hand it to `gridgraph.schedule.explain`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from gridgraph.exec.client.client import Client
from gridgraph.exec.grid import Grid
from gridgraph.schedule import compact
from gridgraph.schedule import explain as text
from gridgraph.schedule.place import naive_placement
from gridgraph.trace.pointer import RemoteTensor


def _target(obj: Any) -> tuple[Client, list[int]]:
    """(client, value ids) for a pointer, several pointers, or a grid's whole pending graph."""
    if isinstance(obj, Grid):
        client = obj.client
        return client, [v for n in client.graph.nodes() for v in n.outputs]
    pointers = [obj] if isinstance(obj, RemoteTensor) else list(_pointers(obj))
    if not pointers:
        raise TypeError("expected a pointer, several pointers, or a grid")
    clients = {id(p._owner): p._owner for p in pointers}
    if len(clients) != 1:
        raise TypeError("these pointers belong to different grids")
    [client] = clients.values()
    return client, [p._vid for p in pointers]


def _pointers(obj: Any) -> Iterable[RemoteTensor]:
    if not isinstance(obj, Iterable):
        raise TypeError(f"expected a pointer, several pointers, or a grid, not {type(obj)}")
    for p in obj:
        if not isinstance(p, RemoteTensor):
            raise TypeError(f"expected pointers, got {type(p).__name__}")
        yield p


def explain(obj: Any) -> str:
    """A text summary of how the work behind `obj` would run: per worker its ops (with your
    file:line), the transfers and their bytes, the stages, the bytes moved, and what the
    naive placement (each op where its largest input lives) would move instead.

    >>> print(gg.explain(y))
    """
    client, vids = _target(obj)
    nodes, placement, plan = client.compile(vids)
    if not nodes:
        where = {client.location_of(v) for v in vids}
        return f"nothing to run: already computed, on {', '.join(sorted(map(str, where)))}"
    _, _, naive = client.compile(vids, lambda n, v, w: naive_placement(n, v))
    graph = client.graph
    return text.explain_plan(
        nodes, graph.values, placement, plan, naive, client.cost, client.workers, graph
    )


def visualize(obj: Any, path: str, *, full: bool = False) -> str:
    """Draw the placement of the work behind `obj` to `path` (.svg, .png, .dot or .html): a
    cluster per worker, transfers labelled with their bytes, values by your names. Compact
    by default: one box per module call (its forward, and its backward) or per line of your
    code, with views, detaches and clones folded in; `full=True` draws every op, by stage.

    >>> gg.visualize(loss, "step.svg")
    'step.svg'
    """
    client, vids = _target(obj)
    nodes, placement, plan = client.compile(vids)
    graph = client.graph
    if full:
        dot = text.to_dot(nodes, graph.values, placement, plan, client.workers, graph.label)
    else:

        def drawn_name(vid: int) -> str | None:  # (optimizer state is folded, named or not)
            return None if graph.is_state(vid) else graph.user_name(vid)

        dot = compact.to_dot(
            nodes, graph.values, placement, plan, client.workers, graph.label, drawn_name
        )
    return text.write(dot, plan, path)
