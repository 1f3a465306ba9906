"""The compact picture of a placed graph: one box per module call or line of your code.

A training step records a few hundred ATen calls, most of them bookkeeping (view, detach, t,
clone). People read it by what they wrote, so this folds the graph into boxes: the ops of
one call of a sent module (`0 (Linear)`, and its backward: `0 (Linear) backward`), else the
ops recorded at one line of the user's code (`opt.step()`), each per worker. A view, detach
or clone outside any module joins the box of the op that made its input. Edges join boxes;
one that crosses workers is a transfer, labelled with what it carries and its bytes.
`gg.visualize(..., full=True)` draws every op instead (`explain.to_dot`).
"""

from __future__ import annotations

import linecache
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from gridgraph.schedule.explain import (
    PALETTE,
    dot_header,
    human_bytes,
    node_stages,
    quote,
    shape,
    stored_value,
    worker_cluster,
)
from gridgraph.schedule.plan import Plan
from gridgraph.trace.graph import Node, Value

# Ops that only re-present a tensor: folded into the box of what made their input.
FOLDED = frozenset({
    "aten::view", "aten::_unsafe_view", "aten::reshape", "aten::detach", "aten::clone",
    "aten::alias", "aten::t", "aten::transpose", "aten::expand", "aten::permute",
    "aten::unsqueeze", "aten::squeeze", "aten::contiguous", "aten::_to_copy",
})  # fmt: skip


@dataclass
class Box:
    """Ops drawn as one: a module call's or a line's, on one worker."""

    key: tuple
    worker: str
    title: str
    where: str
    nodes: list[Node] = field(default_factory=list)
    stages: set[int] = field(default_factory=set)
    kept: int = 0  # stored tensors without a name that only this box reads, not drawn
    joined: list[str] = field(default_factory=list)  # classes of calls folded in (ReLU)

    def label(self) -> str:
        names = list(dict.fromkeys(n.op._schema.name.removeprefix("aten::") for n in self.nodes))
        ops = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        n = len(self.nodes)
        lo, hi = min(self.stages), max(self.stages)
        stage = f"stage {lo}" if lo == hi else f"stages {lo}-{hi}"
        kept = f", reads {self.kept} stored" if self.kept else ""
        title = self.title
        if self.joined:
            head, backward = title.removesuffix(" backward"), title.endswith(" backward")
            title = " + ".join([head, *self.joined]) + " backward" * backward
        return f"{title}\n{n} op{'s' * (n != 1)}: {ops}\n{stage}{kept}"


def _line_title(where: str) -> str:
    """The source text of the user's line (`opt.step()`), else its file:line."""
    path, _, line = where.rpartition(":")
    text = linecache.getline(path, int(line)).strip() if line.isdigit() else ""
    if len(text) > 44:
        text = text[:41] + "..."
    return text or short_where(where)


def short_where(where: str) -> str:
    return where.rsplit("/", 1)[-1] if where else "?"


def boxes(
    nodes: list[Node], placement: Mapping[int, str], stage: Mapping[int, int]
) -> tuple[list[Box], dict[int, Box]]:
    """Group `nodes` into boxes; returns them in first-op order and each node's box."""
    by_key: dict[tuple, Box] = {}
    box_of: dict[int, Box] = {}
    produced_by: dict[int, Node] = {v: n for n in nodes for v in n.outputs}
    # A line's ops after a module call's ops go in a new box: one line that calls a module
    # between its own ops (`loss = F.cross_entropy(model(x), y)`) would else make a cycle.
    segment = 0
    for node in nodes:
        worker = placement[node.id]
        scope = node.meta.get("scope")
        where = node.meta.get("where", "")
        box = None
        if scope is None and node.op._schema.name in FOLDED and node.inputs():
            src = produced_by.get(node.inputs()[0])
            if src is not None and placement[src.id] == worker:
                box = box_of[src.id]
        if box is None:
            if scope:
                key: tuple = ("module", *scope, worker)
                segment += by_key.get(key) is None
            else:
                key = ("line", where, worker, segment)
            box = by_key.get(key)
            if box is None:
                title = scope[0] if scope else _line_title(where)
                box = by_key[key] = Box(key, worker, title, where)
        box.nodes.append(node)
        box.stages.add(stage[node.id])
        box_of[node.id] = box
    return _fold_calls_without_tensors(list(by_key.values()), box_of)


def _fold_calls_without_tensors(
    all_boxes: list[Box], box_of: dict[int, Box]
) -> tuple[list[Box], dict[int, Box]]:
    """A call of a module without tensors of its own (ReLU, MaxPool2d, Flatten) joins the
    call of its sibling next to it on its worker: the one before it in forward, the one
    after it in backward (`features.3 (Conv2d) + ReLU + MaxPool2d`)."""

    def parent(box: Box) -> str | None:
        if box.key[0] != "module":
            return None
        name = box.title.removesuffix(" backward").rsplit(" (", 1)[0]
        return name.rpartition(".")[0] + (" backward" if box.title.endswith(" backward") else "")

    def owns(box: Box) -> bool:
        return box.key[0] != "module" or len(box.key) < 5 or bool(box.key[3])

    merged: dict[int, Box] = {}  # id of a folded box -> the box it joined
    for w in dict.fromkeys(b.worker for b in all_boxes):
        mine = [b for b in all_boxes if b.worker == w]
        for backward in (False, True):
            order = mine[::-1] if backward else mine
            for before, box in zip(order, order[1:]):
                into = merged.get(id(before), before)
                if (
                    not owns(box)
                    and parent(box) is not None
                    and parent(box) == parent(into)
                    and box.title.endswith(" backward") == backward
                ):
                    merged[id(box)] = into
                    cls = box.title.removesuffix(" backward").rsplit(" (", 1)[-1].rstrip(")")
                    into.joined.extend([cls, *box.joined])
                    into.nodes.extend(box.nodes)
                    into.stages |= box.stages
    for nid, box in box_of.items():
        box_of[nid] = merged.get(id(box), box)
    return [b for b in all_boxes if id(b) not in merged], box_of


def to_dot(
    nodes: list[Node],
    values: Mapping[int, Value],
    placement: Mapping[int, str],
    plan: Plan,
    workers: Sequence[str] = (),
    label: Callable[[int], str] = lambda v: f"%{v}",
    user_name: Callable[[int], str | None] = lambda v: None,
) -> str:
    """The compact drawing in Graphviz's language: a cluster per worker, a box per group;
    `label` names the stored values (`features.0.weight`, `relu@train.py:12`); those with
    no `user_name` that one box alone reads are counted in its label, not drawn."""
    stage = node_stages(nodes, placement, plan)
    all_boxes, box_of = boxes(nodes, placement, stage)
    produced = {v for n in nodes for v in n.outputs}
    stored = sorted({v for n in nodes for v in n.inputs() if v not in produced})
    workers = sorted(
        set(workers)
        | set(plan.programs)
        | set(placement.values())
        | {values[v].location for v in stored if values[v].location}
    )
    colour = {w: PALETTE[i % len(PALETTE)] for i, w in enumerate(workers)}
    # Stored tensors with no name that one box on their own worker reads (optimizer state)
    # are counted in that box rather than drawn.
    readers: dict[int, set[int]] = {}
    for n in nodes:
        for v in n.inputs():
            readers.setdefault(v, set()).add(id(box_of[n.id]))
    hidden: dict[int, Box] = {}
    for v in stored:
        [*reader_ids] = readers[v]
        owner = next(b for b in all_boxes if id(b) == reader_ids[0])
        if len(reader_ids) == 1 and owner.worker == values[v].location and not user_name(v):
            hidden[v] = owner
            owner.kept += 1
    ids = {id(b): f"b{i}" for i, b in enumerate(all_boxes)}
    out = dot_header(
        _title(plan), node_font=11, spacing="newrank=true, nodesep=0.15, ranksep=0.35, "
    )
    for w in workers:
        fill, line = colour[w]
        out.append(worker_cluster(w, line, " fontsize=14;"))
        mine = [b for b in all_boxes if b.worker == w]
        here = [v for v in stored if values[v].location == w and v not in hidden]
        for v in here:
            out.append(stored_value(v, f"{label(v)}\n{shape(values, v)}", line, ", fontsize=10"))
        if not mine and not here:
            out.append(f'    idle_{len(out)} [label="idle", shape=plaintext, style=""];')
        for b in mine:
            tip = f"{b.where}: " + ", ".join(n.name for n in b.nodes)
            out.append(
                f"    {ids[id(b)]} [label={quote(b.label())}, fillcolor={quote(fill)}, "
                f"color={quote(line)}, tooltip={quote(tip)}];"
            )
        out.append("  }")
    producer_box = {v: ids[id(box_of[n.id])] for n in nodes for v in n.outputs}
    edges: dict[tuple[str, str], list[int]] = {}
    for n in nodes:
        dst = ids[id(box_of[n.id])]
        for v in n.inputs():
            if v in hidden:
                continue
            src = producer_box.get(v, f"v{v}")
            carried = edges.setdefault((src, dst), []) if src != dst else None
            if carried is not None and v not in carried:
                carried.append(v)
    where_of = {ids[id(b)]: b.worker for b in all_boxes}
    where_of.update({f"v{v}": values[v].location for v in stored})
    for (src, dst), carried in edges.items():
        if where_of[src] == where_of[dst]:
            out.append(f"  {src} -> {dst};")
            continue
        nbytes = sum(values[v].meta.nbytes for v in carried if v in values)
        named = [label(v) for v in carried if user_name(v) or label(v).endswith(".grad")]
        more = f" +{len(named) - 1}" if len(named) > 1 else ""
        text = ", ".join([*named[:1], human_bytes(nbytes)]) if named else human_bytes(nbytes)
        text = text.replace(",", more + ",", 1) if more else text
        colour_dst = colour[where_of[dst]][1]
        out.append(
            f"  {src} -> {dst} [label={quote(text)}, color={quote(colour_dst)}, "
            'penwidth=2.5, style=bold, fontcolor="#000000"];'
        )
    out.append("}")
    return "\n".join(out) + "\n"


def _title(plan: Plan) -> str:
    n_tr = len(plan.transfers)
    return (
        f"{plan.n_stages} stage{'s' * (plan.n_stages != 1)}, {n_tr} transfer"
        f"{'s' * (n_tr != 1)}, {human_bytes(plan.bytes_moved)} moved "
        "(compact: one box per module call or line; gg.visualize(..., full=True) for every op)"
    )
