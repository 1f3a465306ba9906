"""What a placement does, for people: a text summary and a Graphviz drawing.

`explain_plan` lists per worker its ops by stage with the user's file:line, the transfers
with their bytes, the totals, and the same graph under the naive placement for comparison.
`render` draws the graph: one cluster per worker (with a box per stage), nodes coloured by
worker, each transfer as a bold edge labelled with its bytes (further readers of the copy
it brings get dashed edges). `.dot` is written as text; `.svg`
and `.png` go through Graphviz's `dot`; `.html` is the SVG in a minimal page.
"""

from __future__ import annotations

import html
import shutil
import subprocess
from collections.abc import Callable, Mapping, Sequence

from gridgraph.schedule.cost import CostModel, finish_time
from gridgraph.schedule.plan import Plan
from gridgraph.schedule.program import Call, Recv
from gridgraph.trace.graph import Graph, Node, Value

# Fill and border colours per worker (tab10, light and dark), cycled.
PALETTE = [("#aec7e8", "#1f77b4"), ("#ffbb78", "#ff7f0e"), ("#98df8a", "#2ca02c"),
            ("#ff9896", "#d62728"), ("#c5b0d5", "#9467bd"), ("#c49c94", "#8c564b"),
            ("#f7b6d2", "#e377c2"), ("#c7c7c7", "#7f7f7f"), ("#dbdb8d", "#bcbd22"),
            ("#9edae5", "#17becf")]  # fmt: skip


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KB'."""
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


def human_time(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} us"


def node_stages(nodes: list[Node], placement: Mapping[int, str], plan: Plan) -> dict[int, int]:
    """Node id -> the stage of its worker's program that runs it."""
    calls: dict[str, list[int]] = {}
    for w, stages in plan.programs.items():
        calls[w] = [s for s, steps in enumerate(stages) for step in steps if type(step) is Call]
    seen: dict[str, int] = {}
    stage = {}
    for node in nodes:  # a worker's calls are its nodes in recording order
        w = placement[node.id]
        i = seen.get(w, 0)
        seen[w] = i + 1
        stage[node.id] = calls[w][i] if i < len(calls.get(w, ())) else 0
    return stage


def _transfer_stages(plan: Plan) -> dict[tuple[int, str], int]:
    """(value id, destination) -> the destination's stage that receives it."""
    found = {}
    for w, stages in plan.programs.items():
        for s, steps in enumerate(stages):
            for step in steps:
                if type(step) is Recv:
                    found.update(((plan.slots[slot], w), s) for slot in step.slots)
    return found


def shape(values: Mapping[int, Value], vid: int) -> str:
    v = values.get(vid)
    if v is None:
        return "?"
    dims = "x".join(map(str, v.meta.shape)) or "scalar"
    return f"{dims} {str(v.meta.dtype).removeprefix('torch.')}"


def explain_plan(
    nodes: list[Node],
    values: Mapping[int, Value],
    placement: Mapping[int, str],
    plan: Plan,
    naive_plan: Plan | None = None,
    cost: CostModel | None = None,
    workers: Sequence[str] = (),
    graph: Graph | None = None,
) -> str:
    """A readable summary of a compiled (not yet run) plan; with the `graph`, values are
    called by their users' names (`features.0.weight`, else `relu@train.py:12`).

    >>> print(explain_plan(nodes, values, placement, plan, naive_plan))
    placement: 6 ops on 2 of 3 workers, 1 stage, 1 transfer, 1.0 KB moved, ...
    """
    cost = cost or CostModel()
    stage = node_stages(nodes, placement, plan)
    workers = sorted(set(workers) | set(plan.programs) | set(placement.values()))
    n_used = len({placement[n.id] for n in nodes})
    t = finish_time(nodes, values, placement, cost) if nodes else 0.0
    n_tr = len(plan.transfers)
    lines = [
        f"placement: {len(nodes)} ops on {n_used} of {len(workers)} workers, "
        f"{plan.n_stages} stage{'s' * (plan.n_stages != 1)}, {n_tr} transfer{'s' * (n_tr != 1)}, "
        f"{human_bytes(plan.bytes_moved)} moved, estimated finish {human_time(t)}"
    ]
    if naive_plan is not None:
        t_naive = finish_time(nodes, values, naive_plan.placement, cost) if nodes else 0.0
        b_naive, n_naive = naive_plan.bytes_moved, len(naive_plan.transfers)
        lines.append(
            f"naive placement (each op where its largest input lives): {n_naive} "
            f"transfer{'s' * (n_naive != 1)}, {human_bytes(b_naive)} moved, estimated finish "
            f"{human_time(t_naive)}; this placement moves {_ratio(plan.bytes_moved, b_naive)} "
            f"the bytes in {_ratio(t, t_naive)} the time"
        )
    by_worker: dict[str, list[Node]] = {w: [] for w in workers}
    for node in nodes:
        by_worker[placement[node.id]].append(node)
    for w in workers:
        ops = by_worker[w]
        lines.append(f"{w}: {len(ops)} op{'s' * (len(ops) != 1)}")
        last = None
        for node in ops:
            s = stage[node.id]
            head = f"  stage {s}:" if s != last else ""
            last = s
            call = _call(node, graph)
            scope = node.meta.get("scope")
            where = node.meta.get("where", "")
            lines.append(f"{head:<11}{call:<48} {where}{f'  [{scope[0]}]' if scope else ''}")
    n_msg = plan.messages
    lines.append(
        f"transfers: {n_tr}, {human_bytes(plan.bytes_moved)} in {n_msg} message{'s' * (n_msg != 1)}"
    )
    recv_stage = _transfer_stages(plan)
    for tr in plan.transfers:
        s = recv_stage.get((tr.value, tr.dst))
        at = f"  (for stage {s})" if s is not None else ""
        called = f"%{tr.value}" if graph is None else graph.label(tr.value)
        lines.append(
            f"  {called} {shape(values, tr.value)}: {tr.src} -> {tr.dst}, "
            f"{human_bytes(tr.nbytes)}{at}"
        )
    return "\n".join(lines)


def _call(node: Node, graph: Graph | None) -> str:
    """`%7 = aten::mm(x, 0.weight)`: inputs by their user names where they have one."""
    outs = ", ".join(f"%{v}" for v in node.outputs)
    ins = ", ".join(
        (graph.user_name(v) if graph is not None else None) or f"%{v}" for v in node.inputs()
    )
    return f"{outs} = {node.name}({ins})"


def _ratio(a: float, b: float) -> str:
    if b == 0:
        return "1.00x" if a == 0 else "more than"
    return f"{a / b:.2f}x"


# --- Graphviz -------------------------------------------------------------------------------


def quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def dot_header(title: str, node_font: int, spacing: str = "") -> list[str]:
    """The opening lines of a placement picture: its title, and node and edge styles
    (edges one point smaller than nodes); `spacing` adds graph attributes ("nodesep=...")."""
    graph = 'rankdir=TB, fontname="Helvetica", compound=true, ' + spacing
    return [
        "digraph placement {",
        f"  graph [{graph}label={quote(title)}];",
        f'  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize={node_font}];',
        f'  edge [fontname="Helvetica", fontsize={node_font - 1}, color="#555555"];',
    ]


def worker_cluster(worker: str, line: str, attributes: str = "") -> str:
    """The line that opens a worker's box (closed by "  }"), drawn in its colour `line`."""
    return (
        f"  subgraph {quote('cluster_' + worker)} {{\n"
        f"    label={quote(worker)}; color={quote(line)}; penwidth=2; fontcolor={quote(line)};"
        + attributes
    )


def stored_value(vid: int, text: str, line: str, attributes: str = "") -> str:
    """A value stored before the plan runs: an ellipse labelled `text` in its worker's box."""
    return (
        f"    v{vid} [label={quote(text)}, shape=ellipse, fillcolor=white, "
        f"color={quote(line)}{attributes}];"
    )


def to_dot(
    nodes: list[Node],
    values: Mapping[int, Value],
    placement: Mapping[int, str],
    plan: Plan,
    workers: Sequence[str] = (),
    label: Callable[[int], str] = lambda v: f"%{v}",
) -> str:
    """The placed graph in Graphviz's language: a cluster per worker and per stage, every
    op a node; `label` names stored and transferred values."""
    stage = node_stages(nodes, placement, plan)
    produced = {v: n.id for n in nodes for v in n.outputs}
    stored = {v for n in nodes for v in n.inputs() if v not in produced}
    workers = sorted(
        set(workers)
        | set(plan.programs)
        | set(placement.values())
        | {values[v].location for v in stored if values[v].location}
    )
    colour = {w: PALETTE[i % len(PALETTE)] for i, w in enumerate(workers)}
    title = f"placement: {plan.bytes_moved} bytes moved, {plan.n_stages} stages"
    out = dot_header(title, node_font=10)
    for w in workers:
        fill, line = colour[w]
        out.append(worker_cluster(w, line))
        for v in sorted(stored):
            if values[v].location == w:
                out.append(stored_value(v, f"{label(v)}\n{shape(values, v)}", line))
        mine = [n for n in nodes if placement[n.id] == w]
        if not mine and not any(values[v].location == w for v in stored):
            out.append(f'    idle_{len(out)} [label="idle", shape=plaintext, style=""];')
        for s in sorted({stage[n.id] for n in mine}):
            out += [
                f"    subgraph {quote(f'cluster_{w}_s{s}')} {{",
                f"      label={quote(f'stage {s}')}; style=dashed; color={quote(line)};",
            ]
            for n in mine:
                if stage[n.id] == s:
                    outs = ", ".join(f"%{v}" for v in n.outputs[:2])
                    text = f"{n.name.removeprefix('aten::')}\n{outs}\ns{s}"
                    tip = n.meta.get("where", "")
                    out.append(
                        f"      n{n.id} [label={quote(text)}, fillcolor={quote(fill)}, "
                        f"color={quote(line)}, tooltip={quote(tip)}];"
                    )
            out.append("    }")
        out.append("  }")
    sent: set[tuple[int, str]] = set()
    for n in nodes:
        dst = placement[n.id]
        for v in dict.fromkeys(n.inputs()):
            src_node = produced.get(v)
            src = f"n{src_node}" if src_node is not None else f"v{v}"
            where = placement[src_node] if src_node is not None else values[v].location
            if where == dst:
                out.append(f"  {src} -> n{n.id};")
            elif (v, dst) in sent:  # another reader of a copy already sent: no new transfer
                out.append(f"  {src} -> n{n.id} [color={quote(colour[dst][1])}, style=dashed];")
            else:
                sent.add((v, dst))
                nbytes = values[v].meta.nbytes if v in values else 0
                text = f"{label(v)}: {human_bytes(nbytes)}"
                out.append(
                    f"  {src} -> n{n.id} [label={quote(text)}, color={quote(colour[dst][1])}, "
                    'penwidth=2.5, style=bold, fontcolor="#000000"];'
                )
    out.append("}")
    return "\n".join(out) + "\n"


def render(
    nodes: list[Node],
    values: Mapping[int, Value],
    placement: Mapping[int, str],
    plan: Plan,
    path: str,
    workers: Sequence[str] = (),
) -> str:
    """Write the drawing to `path` (.dot, .svg, .png or .html); returns the path.

    >>> render(nodes, values, placement, plan, "placement.svg")
    'placement.svg'
    """
    return write(to_dot(nodes, values, placement, plan, workers), plan, path)


def write(dot: str, plan: Plan, path: str) -> str:
    """Write a drawing in Graphviz's language to `path` (.dot as it is; .svg, .png or
    .html through `dot`); returns the path."""
    kind = path.rsplit(".", 1)[-1].lower() if "." in path else ""
    if kind == "dot":
        with open(path, "w") as f:
            f.write(dot)
        return path
    if kind not in ("svg", "png", "html"):
        raise ValueError(f"cannot render to {path!r}: use a .dot, .svg, .png or .html path")
    image = _graphviz(dot, "png" if kind == "png" else "svg")
    if kind == "html":
        svg = image.decode()
        svg = svg[svg.find("<svg") :]  # drop the XML prolog and doctype
        page = (
            "<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>gridgraph placement"
            f"</title></head>\n<body>\n<h3>{html.escape(_summary(plan))}</h3>\n{svg}</body>"
            "</html>\n"
        )
        image = page.encode()
    with open(path, "wb") as f:
        f.write(image)
    return path


def _summary(plan: Plan) -> str:
    return (
        f"placement over {', '.join(sorted(plan.programs))}: {plan.n_stages} stages, "
        f"{len(plan.transfers)} transfers, {human_bytes(plan.bytes_moved)} moved"
    )


def _graphviz(dot: str, fmt: str) -> bytes:
    exe = shutil.which("dot")
    if exe is None:
        raise RuntimeError(
            "rendering .svg, .png or .html needs Graphviz's `dot` program, which is not on "
            "PATH: install graphviz (apt-get install graphviz, brew install graphviz, or "
            "conda install graphviz), or render to a .dot file instead"
        )
    done = subprocess.run([exe, f"-T{fmt}"], input=dot.encode(), capture_output=True)
    if done.returncode != 0:
        raise RuntimeError(f"dot -T{fmt} failed: {done.stderr.decode(errors='replace')}")
    return done.stdout
