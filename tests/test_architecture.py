"""The layout as a checked fact: what the import contracts in pyproject.toml (run by
`lint-imports` in .ci/run) do not cover: no import cycle among gridgraph's modules (imports
made only for type checking count too), and rooms a newcomer can read."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import grimp
import networkx as nx

PACKAGE = Path(__file__).resolve().parent.parent / "gridgraph"
MAX_LINES = 800  # a module longer than this holds more than one concern
MAX_EXEC_MODULES = 8  # modules directly in gridgraph/exec/: the rest live in its rooms


def _imports() -> nx.DiGraph:
    graph = grimp.build_graph("gridgraph", exclude_type_checking_imports=False)
    g = nx.DiGraph()
    for module in graph.modules:
        g.add_node(module)
        for imported in graph.find_modules_directly_imported_by(module):
            g.add_edge(module, imported)
    return g


def test_no_module_imports_itself_through_others():
    cycles = sorted(" -> ".join([*c, c[0]]) for c in nx.simple_cycles(_imports()))
    assert not cycles, "import cycles (use a Protocol where a lower room calls back up):\n" + (
        "\n".join(cycles)
    )


def test_an_import_cycle_would_be_found():
    g = nx.DiGraph([("gridgraph.a", "gridgraph.b"), ("gridgraph.b", "gridgraph.a")])
    assert list(nx.simple_cycles(g))


def test_no_module_is_longer_than_one_concern_needs():
    long = {
        str(p.relative_to(PACKAGE.parent)): n
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_exec_keeps_its_modules_in_rooms():
    direct = sorted(p.name for p in (PACKAGE / "exec").glob("*.py"))
    assert len(direct) <= MAX_EXEC_MODULES, direct


def test_the_rooms_picture_is_drawn_from_todays_code():
    script = PACKAGE.parent / "scripts" / "draw_rooms.py"
    spec = importlib.util.spec_from_file_location("draw_rooms", script)
    draw_rooms = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(draw_rooms)
    kept = (PACKAGE.parent / "docs" / "rooms.dot").read_text()
    assert kept == draw_rooms.dot_source(), "run: python scripts/draw_rooms.py"
