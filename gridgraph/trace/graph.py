"""The deferred graph: a small IR of recorded ATen calls.

A `Node` is one ATen call. Its arguments are a template in which remote tensors appear as
`Ref(value_id)` and local tensors the user mixed in as `Const(tensor)`. It produces values
(`Node.outputs`): first what the op returns, then a new version of every argument it writes
(in-place ops and ops such as batch norm that update running statistics).

Every value belongs to a storage: a view and its base, and an in-place result and the tensor
it wrote, share one. Storages give the ordering that data edges alone miss: a read of a
storage comes after the last write to it, and a write after every earlier read. These edges
are what make mutation mean in the deferred graph what it means in eager torch.

The graph holds only nodes not yet run (`pending`, with their predecessors in `preds` and the
values along each edge); `Graph.values` keeps the metadata of every value the client knows.
`Graph.names` holds the names users gave storages (`features.0.weight`, `x`): `label` calls a
value by its storage's name, else by the op and line that made it (`relu@train.py:12`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from gridgraph.trace.meta import TensorMeta


class Ref(NamedTuple):
    """A remote tensor in an argument template."""

    value: int


@dataclass(frozen=True, eq=False)
class Const:
    """A local tensor the user mixed into a remote op; it is shipped with the batch.

    `tensor` is its value at the call (a copy: the user may change theirs before the op
    runs); `source` is the user's own tensor, for `gg.compile` to read again on a replay."""

    tensor: torch.Tensor
    source: torch.Tensor | None = field(default=None, repr=False)


@dataclass
class Value:
    """A tensor value: produced by a node, or already stored on a worker (`location`)."""

    id: int
    meta: TensorMeta
    storage: int
    producer: int | None = None  # node id while pending
    location: str | None = None  # worker name once computed
    origin: tuple | None = None  # (op, meta) of the node that made it, once it has run


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
    meta: dict = field(default_factory=dict)  # where: user's file:line; passes add more
    # Written arguments the op does not return: (argument path, value id of the new version).
    written_args: tuple[tuple[Any, int], ...] = ()
    # The call's structure without ids or float values: equal signatures, equal plans.
    sig: Any = None
    params: tuple = ()  # floats and local tensors in the arguments, in argument order
    _inputs: tuple[int, ...] | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return op_name(self.op)

    def inputs(self) -> tuple[int, ...]:
        """Value ids this node reads, in argument order."""
        if self._inputs is None:
            found: list[int] = []
            _collect_refs(self.args, found)
            _collect_refs(tuple(self.kwargs.values()), found)
            self._inputs = tuple(found)
        return self._inputs

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


class Graph:
    """Pending recorded nodes plus the metadata of every known value.

    Recording appends to plain dicts: it must cost microseconds.
    """

    def __init__(self) -> None:
        self.pending: dict[int, Node] = {}  # node id -> node, in recording order
        self.preds: dict[int, dict[int, list[int]]] = {}  # node -> {pred: values along edge}
        self.values: dict[int, Value] = {}
        self._ids = itertools.count(1)
        # Per storage: the pending node that last wrote it, and pending readers since.
        self._last_write: dict[int, int] = {}
        self._readers: dict[int, list[int]] = {}
        # Storage -> (the name a user gave it, the shape it had then); pruned as storages die.
        self.names: dict[int, tuple[str, tuple[int, ...]]] = {}
        self.state: set[int] = set()  # named storages that are an optimizer's state
        self._names_pruned_at = 64

    def new_id(self) -> int:
        return next(self._ids)

    def node(self, node_id: int) -> Node:
        return self.pending[node_id]

    def nodes(self) -> list[Node]:
        """Pending nodes in recording order (a topological order)."""
        return list(self.pending.values())

    def __contains__(self, node_id: int) -> bool:
        return node_id in self.pending

    def __len__(self) -> int:
        return len(self.pending)

    def add_value(
        self,
        meta: TensorMeta,
        storage: int | None = None,
        vid: int | None = None,
        producer: int | None = None,
        location: str | None = None,
    ) -> Value:
        """A new value (a fresh id unless `vid`), on its own storage unless `storage`."""
        vid = next(self._ids) if vid is None else vid
        value = self.values[vid] = Value(
            vid, meta, vid if storage is None else storage, producer, location
        )
        return value

    def name(self, vid: int, name: str, state: bool = False) -> None:
        """Call the storage of value `vid` (and every later version of it) `name`; `state`:
        it is an optimizer's state (a compact picture folds it into what reads it)."""
        value = self.values[vid]
        self.names[value.storage] = (name, tuple(value.meta.shape))
        if state:
            self.state.add(value.storage)
        if len(self.names) > self._names_pruned_at:  # forget names of storages now gone
            live = {v.storage for v in list(self.values.values())}
            self.names = {s: n for s, n in self.names.items() if s in live}
            self.state &= live
            self._names_pruned_at = max(64, 2 * len(self.names))

    def is_state(self, vid: int) -> bool:
        """Whether value `vid`'s storage was named as an optimizer's state."""
        value = self.values.get(vid)
        return value is not None and value.storage in self.state

    def user_name(self, vid: int) -> str | None:
        """The name a user gave this value's storage ('view of w' for a reshaped view)."""
        value = self.values.get(vid)
        named = None if value is None else self.names.get(value.storage)
        if named is None:
            return None
        name, shape = named
        return name if tuple(value.meta.shape) == shape else f"view of {name}"

    def label(self, vid: int) -> str:
        """What to call value `vid` for people: its user name, else `NAME.grad` for the
        gradient of a named parameter, else `op@file:line` of the op that made it, else `%vid`.

        >>> graph.label(3), graph.label(9)
        ('features.0.weight', 'relu@train.py:12')
        """
        name = self.user_name(vid)
        if name is not None:
            return name
        value = self.values.get(vid)
        if value is None:
            return f"%{vid}"
        if value.producer in self.pending:
            node = self.pending[value.producer]
            op, meta = node.op, node.meta
        elif value.origin is not None:
            op, meta = value.origin
        else:
            return f"%{vid}"
        if "grad_of" in meta:
            return f"{meta['grad_of']}.grad"
        where = meta.get("where", "")
        short = where.rsplit("/", 1)[-1] if where and where != "<unknown>" else "?"
        return f"{op._schema.name.removeprefix('aten::')}@{short}"

    def add(self, node: Node) -> None:
        """Add a node whose output values are already in `values`; wire data and order edges."""
        nid = node.id
        pending, values = self.pending, self.values
        last_write, readers = self._last_write, self._readers
        pending[nid] = node
        preds: dict[int, list[int]] = {}
        self.preds[nid] = preds
        for vid in node.inputs():  # data edges, and read-after-write on the storage
            value = values[vid]
            p = value.producer
            if p in pending:
                if p in preds:
                    preds[p].append(vid)
                else:
                    preds[p] = [vid]
            s = value.storage
            w = last_write.get(s)
            if w in pending and w not in preds:
                preds[w] = []
            if s in readers:
                readers[s].append(nid)
            else:
                readers[s] = [nid]
        for _, vid in node.writes:  # write-after-write and write-after-read
            s = values[vid].storage
            for r in (last_write.get(s), *readers.get(s, ())):
                if r in pending and r != nid and r not in preds:
                    preds[r] = []
            last_write[s] = nid
            readers[s] = []

    def last_write(self, storage: int) -> int | None:
        """The pending node that last wrote `storage`, if any."""
        w = self._last_write.get(storage)
        return w if w in self.pending else None

    def needed_for(self, value_ids: list[int]) -> set[int]:
        """Pending node ids that must run for these values to hold their current contents."""
        stack = []
        for vid in value_ids:
            value = self.values[vid]
            if value.producer in self.pending:
                stack.append(value.producer)
            w = self.last_write(value.storage)
            if w is not None:
                stack.append(w)
        needed: set[int] = set()
        while stack:
            nid = stack.pop()
            if nid not in needed and nid in self.pending:  # preds may have run already
                needed.add(nid)
                stack.extend(self.preds[nid])
        return needed

    def remove(self, node_ids: set[int]) -> None:
        """Drop nodes that have run; their values stay in `values` with a location (and
        the op and meta that made them, for `label`)."""
        values = self.values
        for nid in node_ids:
            node = self.pending.pop(nid)
            for vid in node.outputs:
                value = values.get(vid)
                if value is not None:
                    value.origin = (node.op, node.meta)
            del self.preds[nid]
        for s in [s for s, w in self._last_write.items() if w in node_ids]:
            del self._last_write[s]
        for s in list(self._readers):
            readers = [r for r in self._readers[s] if r not in node_ids]
            if readers:
                self._readers[s] = readers
            else:
                del self._readers[s]
