"""Placement: which worker runs each node.

`naive_placement` is the baseline every smarter placement is measured against: an op runs
where its largest input lives. Aliasing is never broken: an op that writes a tensor, or makes
a view of it, runs where that tensor's storage lives, so mutation through views keeps its
meaning.
"""

from __future__ import annotations

from gridgraph.trace.graph import Node, Value


def storage_anchor(node: Node, values: dict[int, Value], where: dict[int, str]) -> str | None:
    """The worker a node must run on because it writes or views a storage, else None."""
    for _, vid in node.writes:
        return where[vid]
    stores = {values[v].storage: v for v in node.inputs()}
    for out in node.outputs:
        value = values.get(out)
        if value is not None and value.storage in stores:
            return where[stores[value.storage]]
    return None


def naive_placement(nodes: list[Node], values: dict[int, Value]) -> dict[int, str]:
    """Each node on the worker holding its largest input (by bytes); first input wins ties."""
    where: dict[int, str] = {}  # value id -> worker, as placed so far

    def loc(vid: int) -> str:
        if vid not in where:
            where[vid] = values[vid].location
        return where[vid]

    placement: dict[int, str] = {}
    for node in nodes:
        inputs = node.inputs()
        for v in inputs:
            loc(v)
        w = storage_anchor(node, values, where) or node.meta.get("pin")
        if w is None:
            w = loc(max(inputs, key=lambda v: values[v].meta.nbytes))
        placement[node.id] = w
        for v in node.outputs:
            where[v] = w
    return placement


# --- the placement compiler ---------------------------------------------------------------
