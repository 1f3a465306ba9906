"""The deferred graph: a small IR of recorded ATen calls.

A `Node` is one ATen call. Its arguments are a template in which remote tensors appear as
`Ref(value_id)` and local tensors the user mixed in as `Const(tensor)`. It produces values
(`Node.outputs`): first what the op returns, then a new version of every argument it writes
(in-place ops and ops such as batch norm that update running statistics).

Every value belongs to a storage: a view and its base, and an in-place result and the tensor
it wrote, share one. Storages give the ordering that data edges alone miss: a read of a
storage comes after the last write to it, and a write after every earlier read. These edges
are what make mutation mean in the deferred graph what it means in eager torch.

`Graph.dag` is a networkx DiGraph over node ids; an edge's `values` attribute lists the
value ids flowing along it (empty for a pure ordering edge). The graph holds only nodes not
yet run; `Graph.values` keeps the metadata of every value the client knows.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import networkx as nx
import torch

from gridgraph.trace.meta import TensorMeta


class Ref(NamedTuple):
    """A remote tensor in an argument template."""

    value: int


@dataclass(frozen=True, eq=False)
class Const:
    """A local tensor the user mixed into a remote op; it is shipped with the batch."""

    tensor: torch.Tensor


@dataclass
class Value:
    """A tensor value: produced by a node, or already stored on a worker (`location`)."""

    id: int
    meta: TensorMeta
    storage: int
    producer: int | None = None  # node id while pending
    location: str | None = None  # worker name once computed


@dataclass(eq=False)
class Node:
    """One recorded ATen call."""

    id: int
    op: torch._ops.OpOverload
    args: tuple
    kwargs: dict
    outputs: tuple[int, ...]  # returned values, then new versions of written args
    returns: str  # 'tensor', 'tuple', 'list' or 'none': how outputs map to the result
    n_returns: int
    writes: tuple[tuple[Any, int], ...]  # (argument path, value id before the write)
    # Written arguments the op does not return: (argument path, value id of the new version).
    written_args: tuple[tuple[Any, int], ...] = ()
    meta: dict = field(default_factory=dict)  # where: user's file:line; passes add more

    @property
    def name(self) -> str:
        return op_name(self.op)

    def inputs(self) -> list[int]:
        """Value ids this node reads, in argument order."""
        found: list[int] = []
        _collect_refs(self.args, found)
        _collect_refs(tuple(self.kwargs.values()), found)
        return found

    def consts(self) -> list[Const]:
        found: list[Const] = []
        _collect_consts(self.args, found)
        _collect_consts(tuple(self.kwargs.values()), found)
        return found

    def __repr__(self) -> str:
        outs = ", ".join(f"%{v}" for v in self.outputs)
        ins = ", ".join(f"%{v}" for v in self.inputs())
        return f"{outs} = {self.name}({ins})"


def op_name(op: torch._ops.OpOverload) -> str:
    """'aten::add.Tensor': the name a worker resolves against its allowlist."""
    schema = op._schema
    return f"{schema.name}.{schema.overload_name}" if schema.overload_name else schema.name


def _collect_refs(obj: Any, out: list[int]) -> None:
    for a in obj:
        if type(a) is Ref:
            out.append(a.value)
        elif isinstance(a, (list, tuple)):
            _collect_refs(a, out)


def _collect_consts(obj: Any, out: list[Const]) -> None:
    for a in obj:
        if type(a) is Const:
            out.append(a)
        elif isinstance(a, (list, tuple)) and type(a) is not Ref:
            _collect_consts(a, out)


class Graph:
    """Pending recorded nodes plus the metadata of every known value."""

    def __init__(self) -> None:
        self.dag = nx.DiGraph()
        self.values: dict[int, Value] = {}
        self._ids = itertools.count(1)
        # Per storage: the pending node that last wrote it, and pending readers since.
        self._last_write: dict[int, int] = {}
        self._readers: dict[int, list[int]] = {}

    def new_id(self) -> int:
        return next(self._ids)

    def node(self, node_id: int) -> Node:
        return self.dag.nodes[node_id]["node"]

    def nodes(self) -> list[Node]:
        """Pending nodes in recording order (a topological order)."""
        return [self.dag.nodes[n]["node"] for n in sorted(self.dag.nodes)]

    def add_value(
        self, meta: TensorMeta, storage: int | None = None, vid: int | None = None, **kw: Any
    ) -> Value:
        vid = self.new_id() if vid is None else vid
        value = Value(vid, meta, vid if storage is None else storage, **kw)
        self.values[vid] = value
        return value

    def add(self, node: Node) -> None:
        """Add a node whose output values are already in `values`; wire data and order edges."""
        nid = node.id
        self.dag.add_node(nid, node=node)
        pending = self.dag
        read_storages = set()
        for vid in node.inputs():
            value = self.values[vid]
            if value.producer is not None and value.producer in pending:
                self._edge(value.producer, nid, vid)
            read_storages.add(value.storage)
        written = {self.values[vid].storage for _, vid in node.writes}
        for s in read_storages | written:
            w = self._last_write.get(s)
            if w is not None and w in pending and w != nid:
                self._edge(w, nid)
        for s in written:
            for r in self._readers.get(s, ()):
                if r in pending and r != nid:
                    self._edge(r, nid)
            self._last_write[s] = nid
            self._readers[s] = []
        for s in read_storages - written:
            self._readers.setdefault(s, []).append(nid)

    def _edge(self, src: int, dst: int, vid: int | None = None) -> None:
        if self.dag.has_edge(src, dst):
            if vid is not None:
                self.dag.edges[src, dst]["values"].append(vid)
        else:
            self.dag.add_edge(src, dst, values=[] if vid is None else [vid])

    def last_write(self, storage: int) -> int | None:
        """The pending node that last wrote `storage`, if any."""
        w = self._last_write.get(storage)
        return w if w is not None and w in self.dag else None

    def needed_for(self, value_ids: list[int]) -> set[int]:
        """Pending node ids that must run for these values to hold their current contents."""
        roots = set()
        for vid in value_ids:
            value = self.values[vid]
            if value.producer is not None and value.producer in self.dag:
                roots.add(value.producer)
            w = self.last_write(value.storage)
            if w is not None:
                roots.add(w)
        needed = set(roots)
        for r in roots:
            needed |= nx.ancestors(self.dag, r)
        return needed

    def subgraph(self, node_ids: set[int]) -> nx.DiGraph:
        return self.dag.subgraph(node_ids)

    def remove(self, node_ids: set[int]) -> None:
        """Drop nodes that have run; their values stay in `values` with a location."""
        self.dag.remove_nodes_from(node_ids)
        for s in [s for s, w in self._last_write.items() if w in node_ids]:
            del self._last_write[s]
        for s in list(self._readers):
            readers = [r for r in self._readers[s] if r not in node_ids]
            if readers:
                self._readers[s] = readers
            else:
                del self._readers[s]

    def forget(self, value_id: int) -> None:
        """The client no longer refers to this value."""
        self.values.pop(value_id, None)
