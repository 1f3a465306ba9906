"""Split a placed graph into per-worker programs: the `Plan` workers run.

A worker's program is a list of steps (call, send, recv, free, return: program.py defines
them, their wire form and their checks) in one global topological order (recording order),
grouped into stages. Values go straight from worker to worker, never via the client.

Coalesced transfers: everything a worker sends one other worker from one of its stages
travels in one message, one `send` step naming several values, and the receiver takes all of
them with one `recv` step, placed at the first of its ops that reads one of them. When a
group is sent, and why no worker can wait for ever, is in `split`'s docstring.

A transfer carries values in row-major order: a value laid out otherwise (a transposed
view) is transposed in place to row-major order around its send and back after its recv,
so both workers hold it in the dimension order the client's metadata says.

Longest chain first: programs are listed, and the sends at one point of a program made, in
order of the PubSub hops that follow them until the client hears the last reply
(`_hops_to_end`), so the client's run message, or the transfer, that heads the longest chain
goes out first (on IPFS each publish takes about a millisecond, one after another).

Steps are grouped into stages: a worker's stage grows by one exactly where it needs a value
from another worker. A worker receives all its stages in one message and moves on to the next
stage as soon as the transfers it needs arrive, with no round trip to the client between.

Programs name values by slot (an index into `Plan.slots`) and Python floats and local tensors
by parameter (an index into `Plan.params`), so a cached plan is reused with new ids and
values, see `cache.py`.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from gridgraph.schedule.program import Call, Free, Param, Recv, Return, Send, Slot, Step, to_wire
from gridgraph.trace.graph import Const, Node, Ref, Value
from gridgraph.trace.meta import TensorMeta


@dataclass(frozen=True)
class TransferEdge:
    """A value moved from one worker to another during a run."""

    value: int
    src: str
    dst: str
    nbytes: int


@dataclass
class Plan:
    """What each worker does in one run, grouped into stages; plain data."""

    programs: dict[str, list[list[Step]]]  # worker -> stages -> steps
    slots: list[int]  # value id of each slot (in the run it was compiled for)
    transfers: list[TransferEdge]
    placement: dict[int, str]  # node id -> worker
    dynamic: dict[int, int] = field(default_factory=dict)  # node id -> call step's slot base
    params_of: dict[str, list[int]] = field(default_factory=dict)  # worker -> params it reads
    node_workers: list[str] = field(default_factory=list)  # worker of each node, in order
    id: int = 0  # set by the plan cache; workers keep programs by it

    @property
    def n_stages(self) -> int:
        return max((len(stages) for stages in self.programs.values()), default=0)

    @property
    def bytes_moved(self) -> int:
        return sum(t.nbytes for t in self.transfers)

    @cached_property
    def peers_of(self) -> dict[str, list[str]]:
        """Per worker, the workers its program sends to or receives from (a run message
        names each one's identity)."""
        return {
            w: sorted({s.worker for st in stages for s in st if type(s) is Send or type(s) is Recv})
            for w, stages in self.programs.items()
        }

    @cached_property
    def wire(self) -> dict[str, list[list[list]]]:
        """Per worker, its program in the list form a run message carries (program.to_wire):
        made once, for the first run of each worker and any that must send it again."""
        return {w: to_wire(stages) for w, stages in self.programs.items()}

    @property
    def messages(self) -> int:
        """Transfer messages a run sends between workers: one per `send` step."""
        return sum(type(step) is Send for st in self.programs.values() for g in st for step in g)

    def __str__(self) -> str:
        lines = []
        for worker in sorted(self.programs):
            for s, steps in enumerate(self.programs[worker]):
                if steps:
                    lines.append(f"{worker} stage {s}:")
                    lines.extend(f"  {step}" for step in steps)
        return "\n".join(lines)


@dataclass
class _Group:
    """One transfer message being planned: values `src` sends `dst` from its stage `stage`.

    `before`: how many steps `src` had when the group's first reader was recorded (a value
    joins only if it is current at a step before that); `at`: the index of the latest step
    of `src` that made one of its values current (the send goes right after it)."""

    src: str
    dst: str
    stage: int
    before: int
    at: int = -1
    recv_stage: int = 0  # the receiver's stage that takes it
    slots: list[int] = field(default_factory=list)
    to_row_major: list[Call] = field(default_factory=list)
    back: list[Call] = field(default_factory=list)

    def add(self, slot: int, at: int, swaps: list[tuple[int, int]]) -> None:
        self.slots.append(slot)
        self.at = max(self.at, at)
        to_row_major = [_transpose(slot, i, j) for i, j in swaps]
        self.to_row_major.extend(to_row_major)
        self.back.extend(to_row_major[::-1])


class _Builder:
    """Turns ids into slots, and floats / local tensors into parameters, while splitting.

    Parameters are numbered in the order recording met them, so a run's values are its
    nodes' `params` one after another (see `run_params`)."""

    def __init__(self) -> None:
        self.slot_of: dict[int, int] = {}
        self.slots: list[int] = []
        self.n_params = 0

    def slot(self, vid: int) -> int:
        s = self.slot_of.get(vid)
        if s is None:
            s = self.slot_of[vid] = len(self.slots)
            self.slots.append(vid)
        return s

    def template(self, a: Any) -> Any:
        if type(a) is Ref:
            return Slot(self.slot(a.value))
        if type(a) is Const or type(a) is float:
            self.n_params += 1
            return Param(self.n_params - 1)
        if isinstance(a, list):
            return [self.template(x) for x in a]
        return a


def makes_views(node: Node, values: Mapping[int, Value]) -> bool:
    """Whether a node only makes views: it writes nothing, and each of its outputs shares
    the storage of one of its inputs (no compute, no new memory)."""
    if node.writes or not node.outputs:
        return False
    read = {values[v].storage for v in node.inputs() if v in values}
    return all(v in values and values[v].storage in read for v in node.outputs)


def run_params(nodes: list[Node]) -> list[Any]:
    """The values of a run's parameters: what the `Param(k)` of its plan stand for."""
    return [p for node in nodes for p in node.params]


def split(
    nodes: list[Node],
    placement: dict[int, str],
    values: dict[int, Value],
    keep: set[int],
    fetch: list[int] = (),
    dynamic: set[int] = frozenset(),
    slots: list[int] | None = None,
) -> Plan:
    """Per-worker programs for `nodes` (in recording order) placed by `placement`.

    `keep`: value ids that must survive the run (everything else is freed after its last
    use); `fetch`: value ids returned to the client; `dynamic`: ids of data-dependent nodes,
    whose result metadata the worker reports; `slots`: the slot order to use (the plan
    cache's canonical order), else slots are numbered as values are met.

    When a group is sent. A value is current at the last step of its sender that made it so:
    the call that produced it, or the last write to its storage recorded before its reader
    (writes run where their storage lives, so they are all on the sender). The group's `send`
    goes right after the latest step that made one of its values current. A value made current
    in the sender's stage S joins the sender's latest group to that receiver for stage S if
      (a) it is current before the group's first reader R in recording order, or
      (b) the sender runs only views (calls that make tensors sharing an input's storage and
          write nothing) between the group's send and the step that makes the value current:
          a view recorded later, of a weight sent earlier, costs no extra message;
    else it opens a new group. So:
      - every value is captured with the contents its reader must see. No write to its storage
        comes between the step that made it current and its reader. In case (a) the send comes
        before R, hence before any write recorded after any reader of the group; in case (b)
        nothing but views runs between a value's capture and the send;
      - within one stage of the sender, grouping delays a value by the sender's own ops only,
        and in case (b) by none.
    No deadlock: every worker runs its steps in the one global order, and a `send` never waits.
    Take a `recv` at global position g: every `recv` its sender meets before the awaited `send`
    is at a position before g (in case (a) the send itself comes before g; case (b) adds no
    `recv` between). So if a worker were blocked forever at a `recv`, its sender would be blocked
    at an earlier one, and so on down a strictly decreasing chain of positions: impossible, as
    the first step of the global order waits for nothing. A value in case (b) reaches its
    receiver before that receiver's op that reads it, as a recv precedes every reader.
    """
    b = _Builder()
    for vid in slots or ():
        b.slot(vid)
    home: dict[int, str] = {}  # value id -> worker that owns it after the run
    present: dict[str, set[int]] = defaultdict(set)  # values on each worker, copies included
    stage: dict[str, int] = defaultdict(int)  # each worker's current stage
    # worker -> (stage, step); a group's recv stands as its _Group until the end
    steps: dict[str, list[tuple[int, Step | _Group]]] = defaultdict(list)
    groups: list[_Group] = []  # transfer messages, in the order they were opened
    open_group: dict[tuple[str, str, int], _Group] = {}  # (src, dst, src's stage) -> latest
    ready: dict[int, int] = {}  # value id -> index of the call that produced it
    last_write: dict[int, int] = {}  # storage -> index of the last call that wrote it
    transfers: list[TransferEdge] = []

    def where(vid: int) -> str:
        if vid in home:
            return home[vid]
        location = values[vid].location
        if location is None:
            raise ValueError(f"value %{vid} is neither computed nor produced in this run")
        home[vid] = location
        present[location].add(vid)
        return location

    def storage(vid: int) -> int | None:
        value = values.get(vid)
        return value.storage if value is not None else None

    busy_at: dict[str, list[int]] = defaultdict(list)  # worker -> its recvs and non-views

    def busy(w: str, at: int) -> int:
        """How many recvs and calls other than views worker w runs up to its step `at`."""
        return bisect_right(busy_at[w], at)

    dynamic_slots: dict[int, int] = {}
    for node in nodes:
        w = placement[node.id]
        s = stage[w]
        recvs = []
        for vid in dict.fromkeys(node.inputs()):
            src = where(vid)
            if vid in present[w]:
                continue
            # Everything recorded before this reader that wrote the value's storage is on
            # `src` already (writes run where their storage lives), so this is the earliest
            # point at which the value has the contents the reader must see.
            at = max(ready.get(vid, -1), last_write.get(storage(vid), -1))
            s_src = steps[src][at][0] if at >= 0 else 0
            group = open_group.get((src, w, s_src))
            if group is not None and at >= group.before and busy(src, at) != busy(src, group.at):
                group = None  # current after the group's first reader, and not by views only
            if group is None:
                group = _Group(src, w, s_src, len(steps[src]))
                open_group[(src, w, s_src)] = group
                groups.append(group)
                recvs.append(group)
                s = max(s, s_src + 1)
            swaps = _layout_swaps(values[vid].meta) if vid in values else []
            group.add(b.slot(vid), at, swaps)
            transfers.append(TransferEdge(vid, src, w, _nbytes(values, vid)))
            present[w].add(vid)
        stage[w] = s
        for r in recvs:
            r.recv_stage = s
            busy_at[w].append(len(steps[w]))
            steps[w].append((s, r))
        outs = [b.slot(v) for v in node.outputs]
        writes = [(path, b.slot(vid)) for path, vid in node.written_args]
        args = b.template(list(node.args))
        kwargs = {k: b.template(v) for k, v in node.kwargs.items()}
        report = node.id in dynamic
        if report:
            dynamic_slots[node.id] = outs[0]
        at = len(steps[w])
        if not makes_views(node, values):
            busy_at[w].append(at)
        steps[w].append((s, Call(node.name, args, kwargs, outs, writes, report)))
        for v in node.outputs:
            home[v] = w
            present[w].add(v)
            ready[v] = at
        for _, vid in node.writes:
            last_write[storage(vid)] = at

    for vid in fetch:
        w = where(vid)
        steps[w].append((stage[w], Return(b.slot(vid))))

    # Each group's send goes right after the latest step that made one of its values current;
    # values laid out otherwise than row-major are transposed around it (see _layout_swaps).
    # Sends at one point go longest chain first, as programs do (see _hops_to_end).
    workers = set(steps) | {g.src for g in groups}
    hops = _hops_to_end({w: stage[w] + 1 for w in workers}, groups)
    sends: dict[str, dict[int, list[Step]]] = defaultdict(lambda: defaultdict(list))
    for g in sorted(groups, key=lambda g: -hops[g.dst, g.recv_stage]):
        sends[g.src][g.at].extend([*g.to_row_major, Send(g.slots, g.dst), *g.back])
    stage_lists: dict[str, list[list[Step]]] = {}
    for w in sorted(workers, key=lambda w: (-hops[w, 0], w)):
        stages: list[list[Step]] = [[] for _ in range(stage[w] + 1)]
        stages[0].extend(sends[w].get(-1, ()))
        for i, (st, step) in enumerate(steps[w]):
            if type(step) is _Group:
                stages[st].extend([Recv(step.slots, step.src), *step.back])
            else:
                stages[st].append(step)
            stages[st].extend(sends[w].get(i, ()))
        stage_lists[w] = stages
    for w, stages in stage_lists.items():
        # Copies received from other workers, and whatever no one needs after the run.
        drop = {v for v in present[w] if home.get(v) != w or v not in keep}
        _insert_frees(stages, drop, b)
    uses = {w: sorted({p for stage in stages for step in stage for p in step.params()})
            for w, stages in stage_lists.items()}  # fmt: skip
    return Plan(
        stage_lists,
        b.slots,
        transfers,
        dict(placement),
        dynamic_slots,
        uses,
        [placement[n.id] for n in nodes],
    )


def _hops_to_end(n_stages: dict[str, int], groups: list[_Group]) -> dict[tuple[str, int], int]:
    """(worker, stage) -> the PubSub hops, one after another, from the start of that stage
    until the client hears the last reply that waits on it.

    A client publishes its run messages one after another, and a worker its sends: each
    publish on IPFS takes about a millisecond. So the plan lists programs, and the sends at
    one point of a program, longest chain first: the run message (or transfer) that starts
    the longest chain of hops goes out first. A send reaches a later stage of its receiver
    than the sender's, so the hops are found stage by stage from the last one back."""
    out_of: dict[tuple[str, int], list[_Group]] = defaultdict(list)
    for g in groups:
        out_of[g.src, g.stage].append(g)
    hops: dict[tuple[str, int], int] = {}
    for s in range(max(n_stages.values(), default=0) - 1, -1, -1):
        for w, n in n_stages.items():
            if s < n:
                after = hops[w, s + 1] if s + 1 < n else 1  # its next stage, or its reply
                hops[w, s] = max([after] + [1 + hops[g.dst, g.recv_stage] for g in out_of[w, s]])
    return hops


def _layout_swaps(meta: TensorMeta) -> list[tuple[int, int]]:
    """Transpositions that bring a tensor of this layout into row-major dimension order.

    A transfer carries values in row-major order, so the receiver's copy would be laid out
    row-major whatever the sender's strides were; but the client's metadata, and torch,
    expect a transposed tensor to stay transposed (ops that follow their input's layout
    give other strides, and as_strided on their results reads other elements). So the
    sender transposes in place to row-major order before sending and back after, and the
    receiver transposes its copy back: the same dimension order at both ends. Dimensions of
    size 1 have no order. Empty for a row-major layout (the common case): nothing added.
    """
    dims = [d for d, n in enumerate(meta.shape) if n > 1]
    ordered = sorted(dims, key=lambda d: -meta.stride[d])  # stable: ties keep their order
    if ordered == dims:
        return []
    target = list(range(len(meta.shape)))
    for d, o in zip(dims, ordered):
        target[d] = o
    current = list(range(len(meta.shape)))
    swaps = []
    for i, want in enumerate(target):
        j = current.index(want)
        if j != i:
            current[i], current[j] = current[j], current[i]
            swaps.append((i, j))
    return swaps


def _transpose(slot: int, i: int, j: int) -> Call:
    """A call step transposing a value in place (metadata only), kept in its own slot."""
    return Call("aten::transpose_", [Slot(slot), i, j], {}, [slot], [], False)


def _nbytes(values: dict[int, Value], vid: int) -> int:
    value = values.get(vid)
    return value.meta.nbytes if value is not None else 0


def _insert_frees(stages: list[list[Step]], drop: set[int], b: _Builder) -> None:
    """Add a `free` step after the last use of each dropped value on this worker."""
    drop_slots = {b.slot_of[v] for v in drop if v in b.slot_of}
    last: dict[int, tuple[int, int]] = {}
    for si, steps in enumerate(stages):
        for i, step in enumerate(steps):
            for slot in [*step.reads(), *step.defines()]:
                if slot in drop_slots:
                    last[slot] = (si, i)
    after: dict[tuple[int, int], list[int]] = defaultdict(list)
    for slot, pos in last.items():
        after[pos].append(slot)
    for si, steps in enumerate(stages):
        out = []
        for i, step in enumerate(steps):
            out.append(step)
            out.extend(Free(slot) for slot in sorted(after.get((si, i), ())))
        stages[si] = out
