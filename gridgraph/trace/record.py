"""Recording: turn one ATen call on remote tensors into a graph `Node`.

`RemoteTensor.__torch_dispatch__` sends every call here. Because we sit below autograd and
below the Python API, tensor methods, torch functions, nn.Module code and the backward pass
all arrive as plain ATen calls and need no per-op code.

For each call we
1. build the argument template (remote tensors become `Ref`, local tensors `Const`) and a
   hashable key of the inputs' metadata, in one walk;
2. infer the output metadata on the meta device (cached by that key);
3. read the op's schema for aliasing: a returned view shares its input's storage, an
   in-place result or a written argument becomes a new version of the tensor it wrote,
   and the user's pointer is rebound to that version;
4. hand the node to the pointer's owner (the client), which runs it at once outside
   `trace()` and defers it inside.

An op the workers do not run (off their allowlist, or a `torch.library.custom_op` outside
the aten namespace) is recorded as what torch itself decomposes it into, when torch has a
decomposition (the tensors that allocates are allocated beside its pointers: allocation.py);
an `out=` form (`torch.mm(a, b, out=o)`) as its functional op and a `copy_` into `o`, when
`o` already has the result's shape and dtype; else it is refused at the call
with `RecordError`.
"""

from __future__ import annotations

import os
import sys
import threading
from contextlib import contextmanager
from functools import cache
from typing import Any, Protocol

import torch

from gridgraph.errors import PlacementError, RecordError
from gridgraph.trace.allocation import AllocateBeside, allocate_in_backward
from gridgraph.trace.allowlist import refusal
from gridgraph.trace.graph import Const, Graph, Node, Ref, op_name
from gridgraph.trace.meta import DataDependent, OutputSpec, TensorMeta, as_sent, extent, infer
from gridgraph.trace.scope import locate

aten = torch.ops.aten
_LOCAL_SCALAR_DENSE = aten._local_scalar_dense.default


class Owner(Protocol):
    """What recording needs from the runtime that owns the pointers (the client). A pointer
    is a pointer.RemoteTensor; recording takes its type as an argument (`record`), so this
    module never imports pointer.py, which calls it."""

    graph: Graph

    def record(self, node: Node, eager: bool) -> None: ...

    def run_data_dependent(self, node: Node) -> tuple[OutputSpec, list[Any]]: ...

    def fetch(self, value_id: int) -> torch.Tensor: ...

    def make_pointer(self, value_id: int) -> torch.Tensor: ...

    def rebind(self, pointer: torch.Tensor, value_id: int) -> None: ...

    def discard(self, node: Node) -> None: ...


# --- trace() -----------------------------------------------------------------------------

_state = threading.local()


def tracing() -> bool:
    """True inside a `trace()` block on this thread."""
    return getattr(_state, "depth", 0) > 0


@contextmanager
def trace():
    """Record torch calls on pointers without running them until a result is needed.

    >>> with gg.trace():
    ...     y = torch.relu(x @ W).sum(1)   # nothing runs yet
    >>> y.compute()                         # one batch per worker per stage
    """
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1


def pinned() -> str | None:
    """The worker name ops recorded now are pinned to (innermost `on` block), if any."""
    stack = getattr(_state, "pins", None)
    return stack[-1] if stack else None


@contextmanager
def on(worker_name: str):
    """Place every op recorded in the block on the named worker."""
    stack = _state.__dict__.setdefault("pins", [])
    stack.append(worker_name)
    try:
        yield
    finally:
        stack.pop()


# --- where the user recorded an op ---------------------------------------------------------

_LIBRARY_DIRS = tuple(
    os.path.dirname(m.__file__) + os.sep
    for m in (sys.modules["gridgraph"], torch)
    if getattr(m, "__file__", None)
)
_SKIP = ("<frozen", "<string>")


# File name -> whether it belongs to gridgraph or torch. Keyed by name, not code object: a
# string caches its hash, a code object hashes its constants and names on every look-up.
_in_library: dict[str, bool] = {}


def in_library(filename: str) -> bool:
    """Whether code in `filename` is gridgraph's or torch's (not the user's)."""
    inside = _in_library.get(filename)
    if inside is None:
        inside = _in_library[filename] = filename.startswith(_LIBRARY_DIRS + _SKIP)
    return inside


def user_frame(skip: int = 0) -> str:
    """file:line of the innermost frame outside gridgraph and torch, looking from `skip`
    frames above the caller (frames the caller knows to be gridgraph's or torch's)."""
    try:
        f: Any = sys._getframe(1 + skip)
    except ValueError:  # the stack is not that deep: no frame of the user's
        return "<unknown>"
    while f is not None:
        fn = f.f_code.co_filename
        inside = _in_library.get(fn)
        if inside is None:
            inside = _in_library[fn] = fn.startswith(_LIBRARY_DIRS) or fn.startswith(_SKIP)
        if not inside:
            return f"{fn}:{f.f_lineno}"
        f = f.f_back
    return "<unknown>"


# --- the schema's aliasing, once per op ----------------------------------------------------

# Ops whose schema does not declare arguments they write (argument indices).
# native_batch_norm updates running_mean and running_var in training mode.
UNDECLARED_WRITES = {"aten::native_batch_norm": (3, 4)}


class Aliasing:
    """Per op: which argument each return aliases, and which arguments it writes."""

    def __init__(self, op: torch._ops.OpOverload) -> None:
        schema = op._schema
        self.arg_names = [a.name for a in schema.arguments]
        self.positional = [not a.kwarg_only for a in schema.arguments]
        owner_of_set: dict[str, int] = {}
        written: list[int] = []
        for i, a in enumerate(schema.arguments):
            if a.alias_info is not None:
                for s in a.alias_info.before_set:
                    owner_of_set[s] = i
                if a.alias_info.is_write:
                    written.append(i)
        written.extend(UNDECLARED_WRITES.get(schema.name, ()))
        # For each return: (argument index it aliases or None, whether it is a write).
        self.returns: list[tuple[int | None, bool]] = []
        for r in schema.returns:
            info = r.alias_info
            if info is None:
                self.returns.append((None, False))
            else:
                src = next((owner_of_set[s] for s in info.before_set if s in owner_of_set), None)
                self.returns.append((src, info.is_write))
        self.written = written
        # Whether the op writes an argument or returns a view of one.
        self.aliases = bool(written) or any(src is not None for src, _ in self.returns)


@cache
def aliasing(op: torch._ops.OpOverload) -> Aliasing:
    return Aliasing(op)


def arg_at(args: tuple, kwargs: dict, alias: Aliasing, index: int) -> tuple[Any, Any]:
    """(path, value) of the schema argument `index` in this call; path is an int or a name."""
    if index < len(args):
        return index, args[index]
    name = alias.arg_names[index]
    return name, kwargs.get(name)


# --- what recording derives from an op and its inputs' metadata, once ------------------------


class Recipe:
    """What recording derives from one op and its inputs' metadata (a call key): the
    workers' verdict on the op, its aliasing, its output metadata and its signature.

    Cached per call key, so recording a step again costs one dictionary look-up per op, not
    a schema walk and a run on the meta device. `refused` says why workers would not run the
    op (then `decomposed` is torch's own decomposition, or None); else `spec` is its output
    metadata and `sigs` its interned signature per pin (`on` block).

    How the outputs are built: an op that writes nothing has `views`, per output the
    positional argument it views (a remote tensor) or None for a fresh tensor; an op that
    writes its first argument and returns it (`add_`) has `in_place`; the rest (other
    writes, views of local tensors) take the general path."""

    __slots__ = (
        "op", "refused", "decomposed", "alias", "spec", "sigs", "checks_layout",
        "views", "in_place",
    )  # fmt: skip

    def __init__(self, op: torch._ops.OpOverload, refused: str | None) -> None:
        self.op = op  # held here, so that the op's id in the key stays this op's
        self.refused = refused
        self.decomposed = decomposition(op) if refused is not None else None
        self.alias = aliasing(op)
        self.spec: OutputSpec | None = None
        self.sigs: dict[str | None, int] = {}
        self.checks_layout = op in _SET_LAYOUT
        self.views: tuple[int | None, ...] | None = None
        self.in_place = False

    def set_spec(self, spec: OutputSpec, t_args: tuple) -> None:
        """Take the output metadata, and choose how outputs are built for calls whose
        template has the structure of `t_args` (the call key fixes it)."""
        self.spec = spec
        alias = self.alias
        returns = [alias.returns[min(i, len(alias.returns) - 1)] for i in range(len(spec.metas))]
        positional_ref = {i for i, a in enumerate(t_args) if type(a) is Ref}
        if not alias.written and not any(is_write for _, is_write in returns):
            if all(src is None or src in positional_ref for src, _ in returns):
                self.views = tuple(src for src, _ in returns)
        elif alias.written == [0] and returns == [(0, True)] and spec.kind == "tensor":
            self.in_place = 0 in positional_ref

    def sig(self, pin: str | None, key: list[Any]) -> int:
        """The interned signature of a call with this recipe, pinned to `pin`."""
        sig = self.sigs.get(pin)
        if sig is None:
            sig = self.sigs[pin] = _intern((self.op, pin, self.spec, *key))
        return sig


# Call key (op id, float arguments, the walk's key) -> Recipe.
_recipes: dict[tuple, Recipe] = {}
_signatures: dict[tuple, int] = {}


def _intern(signature: tuple) -> int:
    """A small int per distinct signature: the plan cache hashes hundreds of these per step."""
    return _signatures.setdefault(signature, len(_signatures))


# --- the recording itself -------------------------------------------------------------------


# Argument types recorded as they are, keyed by value. Checked by exact type before the
# isinstance checks below: the one against torch.Generator runs Python code (its
# metaclass's __instancecheck__) for every argument that reaches it.
_PLAIN_SCALARS = frozenset(
    {int, bool, type(None), str, torch.dtype, torch.layout, torch.memory_format}
)
_new_tuple = tuple.__new__


class _Walk:
    """One walk over a call's arguments: the template, the metadata key, the owner, the
    remote inputs, and the parameters (floats and local tensors: what may change between
    runs of one plan)."""

    __slots__ = ("pointer_type", "owner", "key", "params", "floats", "inputs")

    def __init__(self, pointer_type: type) -> None:
        self.pointer_type = pointer_type
        self.owner: Owner | None = None
        self.key: list[Any] = []
        self.params: list[Any] = []
        self.floats: list[float] = []  # part of the call key: they may shape the output
        self.inputs: list[int] = []  # value ids of the remote tensors, in argument order

    def convert(self, a: Any) -> Any:
        if isinstance(a, self.pointer_type):
            owner = a._owner
            if self.owner is None:
                self.owner = owner
            elif owner is not self.owner:
                raise RecordError("one op mixes pointers from two different grids")
            vid = a._vid
            self.key.append(owner.graph.values[vid].meta)
            self.inputs.append(vid)
            return _new_tuple(Ref, (vid,))  # Ref(vid) without the NamedTuple's Python __new__
        if type(a) in _PLAIN_SCALARS:
            self.key.append((type(a), a))
            return a
        if isinstance(a, torch.Tensor):
            if a.device.type != "cpu":
                raise RecordError(
                    f"a local tensor on device {a.device} is mixed with pointers; "
                    "gridgraph ships local CPU tensors only: call .cpu() first"
                )
            if a.layout != torch.strided:
                raise RecordError(f"tensors with layout {a.layout} are not supported")
            const = Const(as_sent(a, copy=True), a)  # its value now: the op may run later
            self.key.append(("const", TensorMeta.of(const.tensor)))
            self.params.append(const.tensor)
            return const
        if isinstance(a, (list, tuple)):
            self.key.append(len(a))
            return [self.convert(x) for x in a]
        if isinstance(a, torch.Generator):
            raise RecordError(
                "generator= cannot be sent to a worker; seed the worker with "
                "worker.manual_seed(s) instead"
            )
        if isinstance(a, torch.device):
            if a.type not in ("cpu",):
                raise RecordError(f"device {a} is not supported: workers compute on CPU")
            self.key.append(("device", a.type))
            return a
        if type(a) is float:
            self.key.append(float)
            self.params.append(a)
            self.floats.append(a if a == a else "nan")  # NaN != NaN: one key for every NaN
            return a
        if type(a) is complex:  # in the plan, not a parameter: 0j and -0j must differ
            self.key.append((complex, a.real.hex(), a.imag.hex()))
            return a
        self.key.append((type(a), a))
        return a


def to_meta(template: Any, graph: Graph) -> Any:
    """The template with every tensor replaced by a meta tensor of the same layout."""
    if type(template) is Ref:
        return graph.values[template.value].meta.on_meta()
    if type(template) is Const:
        return TensorMeta.of(template.tensor).on_meta()
    if isinstance(template, list):
        return [to_meta(x, graph) for x in template]
    if isinstance(template, torch.device):
        return torch.device("meta")
    return template


def _prepare(op, call_key: tuple, owner: Owner, t_args: tuple, t_kwargs: dict, args, kwargs):
    """The recipe of a call not seen before; cached unless the op is data-dependent."""
    recipe = Recipe(op, refusal(op))
    if recipe.refused is not None:
        _recipes[call_key] = recipe
        return recipe
    graph = owner.graph
    if recipe.checks_layout and type(t_args[0]) is Ref:
        _check_inside_storage(graph, t_args[0].value, args, kwargs)  # before meta's error
    try:
        spec = infer(
            op,
            [to_meta(a, graph) for a in t_args],
            {k: to_meta(v, graph) for k, v in t_kwargs.items()},
        )
    except DataDependent as e:
        if e.error is not None and recipe.alias.aliases:
            raise e.error from None  # a view or in-place op failing on meta: a wrong call
        return recipe  # no spec: the op must run to be known, every time
    recipe.set_spec(spec, t_args)
    _recipes[call_key] = recipe
    return recipe


def record(op: torch._ops.OpOverload, args: tuple, kwargs: dict, pointer_type: type) -> Any:
    """Record one ATen call; return what torch would return (pointers in place of tensors)."""
    if op is _LOCAL_SCALAR_DENSE:  # .item(), bool(p), int(p): a sync point
        p = args[0]
        return p._owner.fetch(p._vid).item()

    walk = _Walk(pointer_type)
    t_args = tuple([walk.convert(a) for a in args])
    key = walk.key
    key.append("|")
    t_kwargs = {}
    for k, v in kwargs.items():
        key.append(k)  # torch leaves out kwargs equal to their default: names count
        t_kwargs[k] = walk.convert(v)
    owner = walk.owner
    assert owner is not None, "dispatch reached gridgraph without a pointer argument"

    # id(op): an OpOverload hashes in Python; the recipe holds the op, so its id is unique.
    call_key = (id(op), tuple(walk.floats), *key)
    recipe = _recipes.get(call_key)
    if recipe is None:
        recipe = _prepare(op, call_key, owner, t_args, t_kwargs, args, kwargs)
    elif recipe.checks_layout and type(t_args[0]) is Ref:
        _check_inside_storage(owner.graph, t_args[0].value, args, kwargs)
    if recipe.refused is not None:
        if recipe.decomposed is None:
            raise RecordError(f"{op_name(op)} cannot run on a worker: {recipe.refused}")
        allocate_in_backward(_custom_op(op), pointer_type)
        with AllocateBeside(_first_pointer(args, kwargs, pointer_type)):
            return recipe.decomposed(*args, **kwargs)  # its ops come back here, one by one

    graph = owner.graph
    spec = recipe.spec
    state = _state.__dict__  # this thread's trace state: the pin and whether to defer
    pins = state.get("pins")
    pin = pins[-1] if pins else None
    eager = not state.get("depth")
    where = user_frame(skip=2)  # this function and RemoteTensor.__torch_dispatch__
    node = Node(
        graph.new_id(),
        op,
        t_args,
        t_kwargs,
        (),
        "" if spec is None else spec.kind,
        0,
        () if not recipe.alias.written else _writes(t_args, t_kwargs, recipe.alias),
        _meta(where, pin, owner.graph),
        (),
        recipe.sig(pin, key),
        tuple(walk.params),
        tuple(walk.inputs),
    )
    if spec is None:
        return _record_data_dependent(owner, node)
    if recipe.views is not None:
        return _record_fresh_or_view(owner, node, spec, recipe.views, eager)
    if recipe.in_place:
        return _record_in_place(owner, node, spec.metas[0], args[0], eager)
    return _record_aliasing(owner, node, spec, recipe.alias, args, kwargs, pointer_type, eager)


def _meta(where: str, pin: str | None, graph: Graph) -> dict:
    """A node's first meta: the user's file:line, the pin, the module call it is in, and
    in backward the name of the parameter whose gradient it makes (`grad_of`)."""
    meta = {"where": where}
    if pin is not None:
        meta["pin"] = pin
    module_call, leaf = locate()
    if module_call is not None:
        meta["scope"] = module_call
    elif leaf is not None:
        vid = getattr(leaf, "_vid", None)
        name = graph.user_name(vid) if vid is not None else None
        if name is not None:
            meta["grad_of"] = name
    return meta


def _record_fresh_or_view(
    owner: Owner, node: Node, spec: OutputSpec, views: tuple[int | None, ...], eager: bool
) -> Any:
    """Record an op that writes nothing: each output is a fresh tensor, or a view of the
    remote tensor at its positional argument in `views` (same storage)."""
    graph = owner.graph
    values = graph.values
    nid = node.id
    if spec.kind == "tensor":  # one output: most ops, without the loops below
        src = views[0]
        storage = None if src is None else values[node.args[src].value].storage
        node.outputs = (graph.add_value(spec.metas[0], storage, producer=nid).id,)
        result = owner.make_pointer(node.outputs[0])
    else:
        vids: list[int | None] = []
        for meta, src in zip(spec.metas, views):
            if meta is None:  # the op returned no tensor here
                vids.append(None)
            else:
                storage = None if src is None else values[node.args[src].value].storage
                vids.append(graph.add_value(meta, storage, producer=nid).id)
        node.outputs = tuple([v for v in vids if v is not None])
        result = _structure(spec.kind, [None if v is None else owner.make_pointer(v) for v in vids])
    node.n_returns = len(node.outputs)
    try:
        owner.record(node, eager=eager)
    except (PlacementError, RecordError):
        owner.discard(node)
        raise
    return result


def _record_in_place(owner: Owner, node: Node, meta: TensorMeta, pointer: Any, eager: bool) -> Any:
    """Record an op that writes its first argument and returns it (`add_`, `t_`): the
    pointer names the new version, with the layout the op gave it."""
    graph = owner.graph
    before = graph.values[pointer._vid]
    value = graph.add_value(meta, before.storage, producer=node.id)
    node.outputs = (value.id,)
    node.n_returns = 1
    owner.rebind(pointer, value.id)
    shaped_before = None
    if meta != before.meta:  # transpose_, squeeze_, resize_ ...
        shaped_before = TensorMeta.of(pointer)
        pointer._set_meta(meta)
    try:
        owner.record(node, eager=eager)
    except (PlacementError, RecordError):
        # Nothing ran: leave the pointer naming what it named before the call.
        owner.rebind(pointer, before.id)
        if shaped_before is not None:
            pointer._set_meta(shaped_before)
        owner.discard(node)
        raise
    return pointer


def _record_aliasing(
    owner: Owner,
    node: Node,
    spec: OutputSpec,
    alias: Aliasing,
    args: tuple,
    kwargs: dict,
    pointer_type: type,
    eager: bool,
) -> Any:
    """Record a view or an in-place op: outputs share storages, written pointers rebind."""
    graph = owner.graph
    results: list[Any] = []
    outputs: list[int] = []
    covered_writes: set[Any] = set()
    restrides: list[tuple[Any, TensorMeta]] = []  # pointers whose shape the op changes
    for i, meta in enumerate(spec.metas):
        if meta is None:  # the op returned no tensor here
            results.append(None)
            continue
        src, is_write = alias.returns[min(i, len(alias.returns) - 1)]
        if src is None:
            value = graph.add_value(meta, producer=node.id)
            results.append(value.id)
        else:
            path, arg = arg_at(args, kwargs, alias, src)
            base = arg[i] if isinstance(arg, (list, tuple)) and is_write else arg
            if not isinstance(base, pointer_type):
                raise RecordError(
                    f"{node.op} writes to or views a local tensor using remote data; "
                    "send that tensor to a worker first"
                )
            storage = graph.values[base._vid].storage
            value = graph.add_value(meta, storage=storage, producer=node.id)
            if is_write:
                if meta != graph.values[base._vid].meta:  # transpose_, squeeze_, resize_ ...
                    restrides.append((base, meta))
                covered_writes.add(path if not isinstance(arg, (list, tuple)) else (path, i))
                results.append(base)
            else:
                results.append(value.id)
        outputs.append(value.id)
    node.n_returns = len(outputs)
    # New versions of written arguments that the op does not return.
    rebinds: list[tuple[Any, int]] = []
    for path, old in node.writes:
        if path in covered_writes:
            continue
        value = graph.add_value(
            graph.values[old].meta, storage=graph.values[old].storage, producer=node.id
        )
        outputs.append(value.id)
        rebinds.append((path, value.id))
    node.outputs = tuple(outputs)
    node.written_args = tuple(rebinds)

    # Pointers: rebind written ones to their new version, make fresh ones for the rest.
    undo: list[tuple[Any, int]] = []  # (pointer, the value it named before)
    returned = iter(outputs)
    for r in results:
        vid = next(returned) if r is not None else None
        if isinstance(r, pointer_type):
            undo.append((r, r._vid))
            owner.rebind(r, vid)
    for path, vid in rebinds:
        p = _pointer_at(args, kwargs, path)
        undo.append((p, p._vid))
        owner.rebind(p, vid)
    shaped_before = [(p, TensorMeta.of(p)) for p, _ in restrides]
    for p, meta in restrides:
        p._set_meta(meta)
    out = [r if r is None or isinstance(r, pointer_type) else owner.make_pointer(r)
           for r in results]  # fmt: skip
    try:
        owner.record(node, eager=eager)
    except (PlacementError, RecordError):
        # Nothing ran: leave every pointer naming what it named before the call.
        for p, vid in reversed(undo):
            owner.rebind(p, vid)
        for p, meta in shaped_before:
            p._set_meta(meta)
        owner.discard(node)
        raise
    return _structure(spec.kind, out)


@cache
def decomposition(op: torch._ops.OpOverload) -> Any:
    """What torch would run `op` as: its composite kernel (ops that reach us from inside a
    decomposition, where autograd no longer expands them), its entry in torch's
    decomposition table, or a custom op's own Python implementation; else None."""
    from torch._decomp import decomposition_table  # heavy: imported on first need
    from torch._library.custom_ops import OPDEFS

    if torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd"):
        return op.decompose
    found = _out_form(op)
    if found is None:
        found = decomposition_table.get(op)
    if found is None:
        found = getattr(OPDEFS.get(op._schema.name), "_init_fn", None)
    return found


@cache
def _custom_op(op: torch._ops.OpOverload) -> Any:
    """`op`'s `torch.library.custom_op` definition, if it is one."""
    from torch._library.custom_ops import OPDEFS

    return OPDEFS.get(op._schema.name)


def _out_form(op: torch._ops.OpOverload) -> Any:
    """For an `out=` overload (`mm.out`), a function that runs its functional overload
    (`mm.default`) and copies the results into the `out` tensors; None for other ops.

    Workers never run `out=` forms: they resize the tensor they write. So a call whose
    `out` tensor lacks the result's shape or dtype is refused here, at the call."""
    schema = op._schema
    outs = [a.name for a in schema.arguments if a.kwarg_only and a.is_out]
    if not outs:
        return None
    inputs = [(a.name, str(a.type)) for a in schema.arguments if a.name not in outs]
    packet = op.overloadpacket
    functional = next(
        (
            overload
            for overload in map(packet.__getattr__, packet.overloads())
            if not overload._schema.is_mutable
            and [(a.name, str(a.type)) for a in overload._schema.arguments] == inputs
        ),
        None,
    )
    if functional is None:
        return None

    def run_then_copy(*args: Any, **kwargs: Any) -> Any:
        targets = [kwargs.pop(name) for name in outs]
        result = functional(*args, **kwargs)
        results = result if isinstance(result, tuple) else (result,)
        for target, value in zip(targets, results):
            if target.shape != value.shape or target.dtype != value.dtype:
                raise RecordError(
                    f"{op_name(op)} would resize or cast its out= tensor "
                    f"({target.dtype} {list(target.shape)} for a {value.dtype} "
                    f"{list(value.shape)} result): workers run no out= form; pass an out "
                    "tensor of the result's shape and dtype, or use the result"
                )
            target.copy_(value)
        return targets[0] if len(targets) == 1 else tuple(targets)

    return run_then_copy


# Views that set their layout at will: on meta tensors they never see the real storage.
_SET_LAYOUT = (aten.as_strided.default, aten.as_strided_.default)


def _check_inside_storage(graph: Graph, vid: int, args: tuple, kwargs: dict) -> None:
    """Raise torch's error, at the call, for a layout reaching past the tensor's storage.

    The storage's size is the largest extent of any value recorded on it (a sent or computed
    tensor covers its storage), so a traced `as_strided` is refused as eagerly as torch
    refuses it, even when nothing ever runs it (a gradient that needs only its shape)."""
    value = graph.values[vid]
    offset = args[3] if len(args) > 3 else kwargs.get("storage_offset")
    offset = value.meta.offset if offset is None else offset
    size, stride = list(args[1]), list(args[2])
    if 0 in size or len(size) != len(stride):
        return
    have = max(
        extent(v.meta.shape, v.meta.stride, v.meta.offset)
        for v in graph.values.values()
        if v.storage == value.storage
    )
    need = extent(size, stride, offset)
    if need > have:
        itemsize = value.meta.dtype.itemsize
        raise RuntimeError(
            f"setStorage: sizes {size}, strides {stride}, storage offset {offset}, and itemsize "
            f"{itemsize} requiring a storage size of {need * itemsize} are out of bounds for "
            f"storage of size {have * itemsize}"
        )


def _writes(t_args: tuple, t_kwargs: dict, alias: Aliasing) -> tuple[tuple[Any, int], ...]:
    """(path, value id) of every remote tensor the op writes, before the write."""
    found = []
    for index in alias.written:
        path, t = arg_at(t_args, t_kwargs, alias, index)
        if type(t) is Ref:
            found.append((path, t.value))
        elif isinstance(t, list):
            found.extend(((path, j), x.value) for j, x in enumerate(t) if type(x) is Ref)
        elif type(t) is Const:
            raise RecordError(
                "an op writes to a local tensor using remote data; send that tensor first"
            )
    return tuple(found)


def _first_pointer(args: tuple, kwargs: dict, pointer_type: type) -> Any:
    for a in (*args, *kwargs.values()):
        found = a if isinstance(a, pointer_type) else None
        if isinstance(a, (list, tuple)):
            found = next((x for x in a if isinstance(x, pointer_type)), None)
        if found is not None:
            return found
    raise AssertionError("dispatch reached gridgraph without a pointer argument")


def _pointer_at(args: tuple, kwargs: dict, path: Any) -> Any:
    if isinstance(path, tuple):
        return _pointer_at(args, kwargs, path[0])[path[1]]
    return args[path] if isinstance(path, int) else kwargs[path]


def _structure(kind: str, out: list[Any]) -> Any:
    if kind == "tensor":
        return out[0]
    if kind == "tuple":
        return tuple(out)
    if kind == "list":
        return list(out)
    return None


# How many value ids to set aside for a data-dependent op's outputs before we know them.
_DYNAMIC_SLOTS = 8


def _record_data_dependent(owner: Owner, node: Node) -> Any:
    """Run an op whose output shape depends on data now (with what it needs), then go on."""
    if node.writes:
        raise RecordError(f"{node.name} writes its inputs and has data-dependent output")
    graph = owner.graph
    node.outputs = tuple(graph.new_id() for _ in range(_DYNAMIC_SLOTS))
    spec, python_values = owner.run_data_dependent(node)
    if spec.kind == "none" and python_values:
        return python_values[0]  # a Python value, e.g. torch.equal
    out = []
    for vid, meta in zip(node.outputs, spec.metas):
        graph.add_value(meta, vid=vid, location=node.meta["location"])
        out.append(owner.make_pointer(vid))
    return _structure(spec.kind, out)
