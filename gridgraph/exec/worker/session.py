"""One client session on a worker: its state, and running its programs.

A client is an authenticated peer plus the session id it chose; everything a worker keeps
for it lives in its `Session` and nowhere else, so no other peer can read, evict, reseed or
reset any of it:

    store      its tensors by value id (store.py)
    programs   its compiled programs by plan id, the PROGRAMS_KEPT most recently used
    records    request id -> the reply sent (None while queued or running): a request id
               runs at most once. Replies are kept for the REPLIES_KEPT latest requests and
               bare ids for the RECORDS_KEPT latest (a resend of an older one is told so)
    rng        its random stream (`worker.manual_seed` seeds only this)
    reply_topic  where its client hears replies: the sender's own topic for the session id
               (worker.client_topic), set when a request is accepted; no request names it
    traffic    messages and bytes the worker sent for it; `ops_run`
    sent       transfers it sent to other workers, kept for resending (ipfs) to the identity
               they were sent to, and to no other
    inbox      transfers other workers sent it, by (run, first value id, sending worker) and
               the identity that sent each (the transport's authenticated sender), each as
               received: decoded only when a run takes it (decoded, a message of many small
               tensors holds tens of times its bytes). Charged to the session when its
               sender is a worker identity one of its runs named (`named`), else to the
               sender (worker.py)
    queue      its requests waiting to run, in arrival order; their bytes (`queued_bytes`)
               stay under the memory limit on their own (worker.py refuses one past it), and
               one that came while others waited is kept as received, decoded when served

All of it counts against the session's memory limit (`memory()`), and all of it goes when the
client says `bye` or its lease expires. A session's requests run one at a time, in order, on
a thread of its own (worker.py starts it), so one client's long program or blocked `recv`
delays no other client.

Running a program: every step is checked when the program arrives (`Program`), and each call
step is prepared then, once (`CompiledCall`: its op resolved from the allowlist, its arguments
a template with the slot and parameter positions to fill), so a replay of a cached program
looks up no names and dispatches on no argument types; before a run,
the shapes of everything it creates are worked out on the meta device from the stored inputs
(`Program.footprint`), with a bound on the scratch memory each op takes while it runs
(`limits.op_scratch`), so a run that would break the memory or time limit is refused before
any step runs (a run's slots name distinct values, and inputs that are one tensor object
share one meta tensor, so what the walk sees is what the run will hold). Steps whose inputs
only arrive during the run (a `recv`) are checked just before they run, each from a walk of
the same kind over the steps up to the next recv, made once the recv has stored what it
received (`Stretch`); walks are remembered per layout of what they read (a replayed step
receives the same layouts every time). An op whose output size its data sets (bincount,
nonzero), and the ops that read what it made, are checked just before they run, from a
bound read off its arguments (`limits.data_dependent_footprint`), or from a meta run on
theirs (`CompiledCall.footprint`). A call whose meta kernel refuses its arguments fails
with that kernel's error when it is reached: its real kernel never runs (CPU kernels have
taken what their meta kernels refuse, and read past memory). Every result is
bounds-checked, the memory limit is checked after every call (from running byte counts) and
the time limit before every step. A run that fails undoes what it stored. The work the
footprint finds for a call also sets how many intra-op threads it runs on (intraop.py).

Transfers between workers: a run message names the identity of every worker its `send` and
`recv` steps name (`peers`, which the client takes from its own view of the grid, where its
`trust` and pinning hold); a run without one is refused. A `send` goes to that identity only
(and is resent to it only), and a `recv` takes only the transfer that identity sent: one
from any other sender, even under the same key and earlier, is never used, and is dropped
when the real one is taken. So no view of the worker's own decides whom a client's data goes
to or comes from.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import traceback
from collections import OrderedDict, deque
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any, Protocol

import torch

from gridgraph.exec import resend, wire
from gridgraph.exec.protocol import MAX_NAME, UNKNOWN_PLAN, is_name
from gridgraph.exec.safety.limits import (
    RECORD_BYTES,
    TRANSFER_BYTES,
    LimitExceeded,
    Limits,
    TimeLimitExceeded,
    data_dependent_footprint,
    meta_like,
    op_footprint,
)
from gridgraph.exec.transport import TrafficCounter
from gridgraph.exec.worker import intraop
from gridgraph.exec.worker.ops import (
    RandomState,
    check_bounds,
    check_view,
    resizes,
    runner,
)
from gridgraph.exec.worker.store import ObjectStore
from gridgraph.schedule.plan import Param, Slot, call_refs
from gridgraph.trace.allowlist import OpRefused, resolve


class Host(Protocol):
    """Where a session's programs run: the worker itself, or an executor process."""

    name: str
    limits: Limits
    recv_timeout: float

    def transfer(self, session: Session, dst: str, peer: str, msg: dict) -> None:
        """Send a transfer message to worker `dst`, whose identity is `peer` (its key: see
        `transfer_key`)."""

    def receive(
        self,
        session: Session,
        key: tuple[int, int, str],
        peer: str,
        deadline: float,
        ask_after: float,
    ) -> dict:
        """The transfer message `key` = (run, its first value id, sending worker) that the
        identity `peer` sent, waiting until `deadline`, and asking `peer` to send it again
        if it has not come after `ask_after` s (bounded by `resend_wait`); raises UpstreamFailed,
        TimeoutError or TimeLimitExceeded."""


log = logging.getLogger("gridgraph.worker")

PROGRAMS_KEPT = 64  # compiled programs kept per session, least recently used dropped
NAMED_KEPT = 256  # identities of workers a session's runs named, the latest kept
CALL_STEP_BYTES = 1024  # a prepared call step (CompiledCall), about; see held_bytes
FOOTPRINTS_KEPT = 8  # per program and per call step: footprints remembered, by layouts
REPLIES_KEPT = 16  # latest replies kept per session, to answer a resent request again
RECORDS_KEPT = 100_000  # latest request ids remembered per session (~RECORD_BYTES each)
TRANSFERS_KEPT = 1024  # ipfs: transfers kept per session for resending, and received ids
# ipfs: PubSub drops messages: a recv waiting this long asks the sender to resend; sooner
# in a replayed program, whose earlier runs say how long the wait takes (exec/resend.py).
RESEND_AFTER = 0.5


def resend_wait(seconds: float) -> float:
    """How long a recv waits before it first asks for its transfer again, from what its
    program asks (`seconds`, an executor's word): at least resend.FLOOR and at most
    RESEND_AFTER, so that no program makes its worker ask another more often, or later,
    than that."""
    return min(RESEND_AFTER, max(resend.FLOOR, seconds))


# A transfer message carries the values one `send` step names: {"kind": "transfer", "client",
# "run", "src", "values": [value id, ...], "tensors": [tensor, ...]}, or "error" in place of
# the tensors when the sender failed. Its key, at both ends, is (run, first value id, src);
# the receiver keeps it with its sender's identity, and a run takes it only from the identity
# it names for `src`.


def transfer_key(msg: dict) -> tuple[int, int]:
    """(run, first value id) of a transfer message this worker made."""
    return msg["run"], msg["values"][0]


def one_tensor_per_value(values: list, tensors: object) -> bool:
    """Whether a transfer's tensors match its value ids: one each, no id twice."""
    return (
        isinstance(tensors, list)
        and len(tensors) == len(values)
        and all(isinstance(t, torch.Tensor) for t in tensors)
        and all(type(v) is int for v in values)
        and len(set(values)) == len(values)
    )


class RequestError(Exception):
    """A request that cannot be served; its message goes back to the sender."""

    def __init__(self, message: str, code: str = "refused") -> None:
        super().__init__(message)
        self.code = code


class UpstreamFailed(Exception):
    """A value this worker waited for was never computed because its producer failed."""


class Record:
    """What a session remembers of one request: its reply once sent, and when it went out."""

    __slots__ = ("reply", "sent_at", "resent")

    def __init__(self) -> None:
        self.reply: bytes | None = None  # None: queued or running, or the reply was dropped
        self.sent_at = math.inf  # monotonic time the reply went out (inf until it did)
        self.resent = 0  # times the reply was sent again (worker.RESENDS at most)


class Session:
    """Everything a worker keeps for one client; see the module docstring."""

    def __init__(self, key: str, peer: str) -> None:
        self.key, self.peer = key, peer
        # Where its client hears replies (worker.client_topic of the sender and session id of
        # its requests): set by the worker when it accepts one, never named by a request.
        self.reply_topic = ""
        # The identity whose transfer opened it, until its client's first request (worker.py)
        self.opened_by: str | None = None
        self.store = ObjectStore()
        self.programs: OrderedDict[int, Program] = OrderedDict()
        self.records: OrderedDict[str, Record] = OrderedDict()
        self.rng = RandomState()
        self.traffic = TrafficCounter()
        self.ops_run = 0
        # (run, first value id, receiving worker) -> [its identity, the transfer, resends]
        self.sent: OrderedDict[tuple[int, int, str], list] = OrderedDict()
        # (run, first value id, sending worker) -> sender's identity -> the message received
        self.inbox: dict[tuple[int, int, str], dict[str, bytes]] = {}
        # Identities its runs named as workers (`peers`), the NAMED_KEPT latest: what they
        # send it is its own data, charged to it. What others send is charged to its sender
        # (worker.py): no one else's transfers use up this session's memory.
        self.named: OrderedDict[str, None] = OrderedDict()
        self.stray: set[tuple[tuple[int, int, str], str]] = set()  # (key, sender) not named
        self.release_stray: Callable[[str, int], None] = lambda sender, nbytes: None
        self.received: OrderedDict[tuple[int, int, str], None] = OrderedDict()
        self.aborted: OrderedDict[Any, None] = OrderedDict()  # runs the client gave up on
        # (request, or None until served if it came while others waited; arrival; payload)
        self.queue: deque[tuple[dict | None, float, bytes]] = deque()
        self.queued_bytes = 0  # of the payloads in `queue`
        self.busy = False  # a request is queued or running
        self.serving = False  # a thread serves the queue (running, or waiting for more)
        self.closed = False
        self.last_seen = time.monotonic()
        self.cv = threading.Condition()  # guards inbox, received, aborted, closed
        # the process running its programs (isolation/executor.py), if any
        self.executor: Any = None
        self.elsewhere = 0  # bytes the other process (worker or executor) holds for it
        self._reply_bytes = 0
        self._with_reply: deque[Record] = deque()  # records holding a reply, oldest first
        self._inbox_bytes = 0
        self._sent_bytes = 0
        self._program_bytes = 0

    # --- memory ----------------------------------------------------------------------------

    def memory(self) -> int:
        """Bytes this session holds: tensors, inbox, kept transfers, replies, programs."""
        return (
            self.store.stored_bytes
            + self._inbox_bytes
            + self._sent_bytes
            + self._reply_bytes
            + self._program_bytes
            + RECORD_BYTES * len(self.records)
            + self.elsewhere
        )

    # --- request records -------------------------------------------------------------------

    def record(self, rid: str) -> Record:
        """A new record for request `rid`, dropping the oldest ones past the caps."""
        rec = self.records[rid] = Record()
        while len(self.records) > RECORDS_KEPT:
            _, old = self.records.popitem(last=False)
            self._reply_bytes -= len(old.reply or b"")
            old.reply = None
        return rec

    def replied(self, rec: Record, reply: bytes) -> None:
        """Keep `reply` for resends; only the REPLIES_KEPT latest replies stay (a queue of
        the records holding one, so this costs the same after a million requests)."""
        rec.reply = reply
        self._reply_bytes += len(reply)
        self._with_reply.append(rec)
        while len(self._with_reply) > REPLIES_KEPT:
            old = self._with_reply.popleft()
            if old.reply is not None:
                self._reply_bytes -= len(old.reply)
                old.reply = None

    # --- programs --------------------------------------------------------------------------

    def add_program(self, plan_id: int, program: Program) -> None:
        old = self.programs.pop(plan_id, None)
        if old is not None:
            self._program_bytes -= old.nbytes
        self.programs[plan_id] = program
        self._program_bytes += program.nbytes
        while len(self.programs) > PROGRAMS_KEPT:
            _, dropped = self.programs.popitem(last=False)
            self._program_bytes -= dropped.nbytes

    # --- transfers -------------------------------------------------------------------------

    def keep_sent(
        self, key: tuple[int, int, str], peer: str, payload: bytes, cap: int | None = None
    ) -> None:
        """Keep a transfer this session sent to identity `peer`, for a resend (ipfs): the
        TRANSFERS_KEPT latest, within the room the rest of the session's memory leaves
        under `cap` (None: no limit). The oldest go first; one larger than that room is not
        kept (it cannot be sent again)."""
        _, old, _ = self.sent.pop(key, ("", b"", 0))
        self._sent_bytes -= len(old)
        room = None if cap is None else cap - (self.memory() - self._sent_bytes)
        if room is not None and len(payload) > room:
            return
        self.sent[key] = [peer, payload, 0]
        self._sent_bytes += len(payload)
        while len(self.sent) > TRANSFERS_KEPT or room is not None and self._sent_bytes > room:
            _, (_, dropped, _) = self.sent.popitem(last=False)
            self._sent_bytes -= len(dropped)

    def name_workers(self, identities: Any) -> None:
        """Identities a run of this session named for its workers. What a run may not name
        (`is_name`) is not kept: the run is refused for it (`_peers`)."""
        for identity in identities:
            if is_name(identity):
                self.named[identity] = None
                self.named.move_to_end(identity)
        while len(self.named) > NAMED_KEPT:
            self.named.popitem(last=False)

    def deliver(
        self, key: tuple[int, int, str], sender: str, payload: bytes, stray: bool = False
    ) -> bool:
        """A transfer message arrived from identity `sender` (`payload` as received, checked);
        wake a waiting recv. Kept per sender: one from another identity cannot take its
        place. `stray`: from an identity no run of the session named, charged to that
        sender (the caller did) and not to the session. False if it was not kept."""
        with self.cv:
            got = self.inbox.get(key, {})
            if key in self.received or sender in got or self.closed:
                return False  # ipfs: a resent copy of one already here or used
            got[sender] = payload
            self.inbox[key] = got
            if stray:
                self.stray.add((key, sender))
            else:
                self._inbox_bytes += len(payload) + TRANSFER_BYTES
            self.cv.notify_all()
            return True

    def inbox_fits(self, payload: bytes, cap: int | None) -> bool:
        """Whether keeping `payload` in the inbox (charged as `deliver` charges it) leaves
        this session within `cap` bytes (None: no limit)."""
        return cap is None or self.memory() + len(payload) + TRANSFER_BYTES <= cap

    def has_transfer(self, key: tuple[int, int, str], sender: str) -> bool:
        """Whether identity `sender`'s transfer `key` is here (the caller holds `cv`)."""
        return sender in self.inbox.get(key, ())

    def take(self, key: tuple[int, int, str], sender: str) -> bytes:
        """Remove and return identity `sender`'s transfer `key` as received, and drop the
        ones other identities sent under that key (the caller holds `cv`)."""
        got = self.inbox.pop(key)
        for who, p in got.items():
            self._uncharge(key, who, p)
        payload = got.pop(sender)
        for other in got:
            log.warning("client %s: dropped a transfer claiming to come from %s: sent by %s, "
                        "not by the identity its run names", self.key, key[2], other)  # fmt: skip
        self.received[key] = None
        while len(self.received) > TRANSFERS_KEPT:
            self.received.popitem(last=False)
        return payload

    def _uncharge(self, key: tuple[int, int, str], sender: str, payload: bytes) -> None:
        """Stop charging a transfer that leaves the inbox, to whoever it was charged to."""
        if (key, sender) in self.stray:
            self.stray.discard((key, sender))
            self.release_stray(sender, len(payload) + TRANSFER_BYTES)
        else:
            self._inbox_bytes -= len(payload) + TRANSFER_BYTES

    def abort(self, run: Any) -> None:
        if type(run) is not int:
            return
        with self.cv:
            self.aborted[run] = None
            while len(self.aborted) > TRANSFERS_KEPT:
                self.aborted.popitem(last=False)
            self.cv.notify_all()

    # --- end -------------------------------------------------------------------------------

    def end_if_idle(self) -> bool:
        """Mark this session ended, unless a request of it waits or runs (then False). From
        then on its requests are refused (the worker checks `closed`); `close` frees the
        rest."""
        with self.cv:
            if self.busy:
                return False
            self.closed = True
            return True

    def close(self) -> int:
        """Free everything this session holds; returns the number of tensors freed."""
        with self.cv:
            self.closed = True
            for key, got in self.inbox.items():
                for sender, payload in got.items():
                    self._uncharge(key, sender, payload)
            self.inbox.clear()
            self.cv.notify_all()
        n = self.store.clear()
        if self.executor is not None:
            self.executor.close()
        self.programs.clear()
        self.records.clear()
        self._with_reply.clear()
        self.sent.clear()
        self.queue.clear()
        self.queued_bytes = 0
        self._reply_bytes = self._inbox_bytes = self._sent_bytes = self._program_bytes = 0
        return n


# --- serving one request ----------------------------------------------------------------------


def answer(host: Host, session: Session, msg: dict, nbytes: int) -> bytes:
    """Serve one accepted request of `session`; its reply, an error reply if anything fails.

    Runs where the session's state lives: in the worker (in-process) or in the session's
    executor process (isolation/executor.py). `bye` is the worker's own business.
    """
    rid, kind = msg["id"], msg["kind"]
    try:
        frees = msg.get("free", [])
        if not isinstance(frees, list) or not all(type(v) is int for v in frees):
            raise RequestError("'free' must be a list of value ids")
        body = {"ok": True, **_HANDLERS[kind](host, session, msg, frees, nbytes)}
    except (RequestError, wire.WireError, OpRefused, LimitExceeded) as e:
        log.warning("%s: refused a %r request from %s: %s", host.name, kind, session.key, e)
        body = error_body(host.name, e)
    except Exception as e:  # a bug, or a failure outside a program: still one reply
        log.exception("%s: %r request from %s failed", host.name, kind, session.key)
        body = error_body(host.name, e)
    return encode_reply(host.name, rid, body)


def encode_reply(worker: str, rid: str, body: dict) -> bytes:
    """The reply message; if the body cannot be encoded, an error reply saying why."""
    try:
        return wire.encode({"kind": "reply", "re": rid, "worker": worker, **body})
    except Exception as e:  # a result that cannot be sent: the client still hears why
        log.warning("%s: could not encode the reply to %s: %s", worker, rid, e)
        error = error_body(worker, RequestError(f"the reply could not be encoded: {e}"))
        return wire.encode({"kind": "reply", "re": rid, "worker": worker, **error})


def error_body(worker: str, error: Exception) -> dict:
    """The reply to a refused request: nothing it asked for happened, not even its frees."""
    code = getattr(error, "code", "refused")
    return {
        "ok": False,
        "error": {"worker": worker, "message": str(error), "code": code, "refused": True},
    }


def _free(session: Session, frees: list[int]) -> None:
    for vid in frees:
        session.store.free(vid)


def _ping(host: Host, session: Session, msg: dict, frees: list[int], nbytes: int) -> dict:
    _free(session, frees)  # "free" requests too: every request carries releases
    return {}


def _put(host: Host, session: Session, msg: dict, frees: list[int], nbytes: int) -> dict:
    values = msg.get("values")
    if not isinstance(values, list) or not all(
        isinstance(item, list)
        and len(item) == 2
        and type(item[0]) is int
        and isinstance(item[1], torch.Tensor)
        for item in values
    ):
        raise RequestError("put values must be [value id, tensor] pairs")
    size = sum(t.untyped_storage().nbytes() for _, t in values)
    after = session.memory() - session.store.bytes_freed_by(frees) + size
    host.limits.check_memory(after, "storing these tensors")
    _free(session, frees)
    for vid, tensor in values:
        session.store.put(vid, tensor)
    return {}


def _seed(host: Host, session: Session, msg: dict, frees: list[int], nbytes: int) -> dict:
    seed = msg.get("seed")
    if type(seed) is not int:
        raise RequestError("seed must be an int")
    session.rng.manual_seed(seed)
    _free(session, frees)
    return {}


def _stats(host: Host, session: Session, msg: dict, frees: list[int], nbytes: int) -> dict:
    _free(session, frees)
    out = {
        "objects": len(session.store),
        "stored_bytes": session.store.stored_bytes,
        "memory": session.memory(),
        "ops_run": session.ops_run,
        "messages": session.traffic.messages,
        "bytes": session.traffic.bytes,
    }
    if msg.get("reset"):
        session.traffic.reset()
        session.ops_run = 0
    return out


def _run(host: Host, session: Session, msg: dict, frees: list[int], nbytes: int) -> dict:
    start = time.monotonic()
    run, plan_id, slots = msg.get("run"), msg.get("plan"), msg.get("slots")
    params = msg.get("params")
    if type(run) is not int or type(plan_id) is not int or not isinstance(slots, list):
        raise RequestError("a run needs 'run', 'plan' and 'slots'")
    if not all(type(v) is int for v in slots):
        raise RequestError("slots must be value ids")
    if len(set(slots)) != len(slots):  # two slots over one value: the footprint, worked out
        raise RequestError("slots must name distinct values")  # per slot, would not hold
    if not isinstance(params, list) or not all(
        isinstance(p, list) and len(p) == 2 and type(p[0]) is int for p in params
    ):
        raise RequestError("params must be [index, value] pairs")
    params = dict(params)
    if "program" in msg:
        program = Program(msg["program"], len(slots), nbytes)
    else:
        program = session.programs.get(plan_id)
        if program is None:
            raise RequestError(f"unknown plan {plan_id}: send its program again", UNKNOWN_PLAN)
    if len(slots) != program.n_slots or not program.params <= params.keys():
        raise RequestError(f"run of plan {plan_id} does not fit its program")
    peers = _peers(msg.get("peers", {}), program, plan_id)
    # Checked from meta shapes before anything runs or changes; frees count as done.
    peak, work, checked = program.footprint(session.store, slots, params)
    held = session.memory() - session.store.bytes_freed_by(frees)
    if "program" in msg and plan_id not in session.programs:
        held += program.nbytes
    host.limits.check_memory(held + peak, f"run {run} (plan {plan_id})")
    host.limits.check_work(work, f"run {run} (plan {plan_id})")
    if "program" in msg:
        session.add_program(plan_id, program)
    session.programs.move_to_end(plan_id)
    _free(session, frees)
    deadline = host.limits.deadline(start)
    return Run(host, session, run, slots, params, peers, deadline).execute(program, checked)


def _peers(peers: Any, program: Program, plan_id: int) -> dict[str, str]:
    """The run's `peers`, checked: an identity for each worker it names."""
    if not isinstance(peers, dict) or not all(
        is_name(name) and is_name(identity) for name, identity in peers.items()
    ):
        raise RequestError(
            f"'peers' must map worker names to their identities (each of at most {MAX_NAME} "
            "characters)"
        )
    unnamed = sorted(program.workers - peers.keys())
    if unnamed:
        raise RequestError(
            f"run of plan {plan_id} sends to or receives from {', '.join(unnamed)}, whose "
            "identity 'peers' does not give"
        )
    return peers


def _bye(host: Host, session: Session, msg: dict, frees: list[int], nbytes: int) -> dict:
    return {"freed": session.store.clear()}  # in an executor; the worker forgets the rest


_HANDLERS = {"put": _put, "run": _run, "seed": _seed, "stats": _stats, "free": _ping,
             "ping": _ping, "bye": _bye}  # fmt: skip


class Program:
    """A checked program: every step well-formed, every slot and parameter in range."""

    def __init__(self, stages: Any, n_slots: int, nbytes: int) -> None:
        if not isinstance(stages, list) or not all(isinstance(st, list) for st in stages):
            raise RequestError("a program is a list of stages, each a list of steps")
        self.steps = [step for stage in stages for step in stage]
        self.n_slots = n_slots
        # What keeping it costs its session, roughly: its decoded steps, not the bytes it
        # came in (an empty list is 1 byte on the wire and 64 in memory).
        self.nbytes = max(nbytes, held_bytes(self.steps))
        self.params: set[int] = set()
        for step in self.steps:
            _check_step(step, n_slots, self.params)
        # The workers it sends to or receives from: a run names each one's identity.
        self.workers = {step[2] for step in self.steps if step[0] in ("send", "recv")}
        # Each call step prepared once (its op resolved, its arguments turned into
        # accessors), so a run does no name lookup and no per-argument type dispatch.
        self.calls: dict[int, CompiledCall] = {
            i: CompiledCall(step) for i, step in enumerate(self.steps) if step[0] == "call"
        }
        # Walked on meta before a run: all its steps. After each recv: the steps up to the
        # next recv (each step in one such stretch, so what they remember stays in
        # proportion to the program).
        self.whole = Stretch(self.steps, self.calls, 0, len(self.steps))
        recvs = [i for i, step in enumerate(self.steps) if step[0] == "recv"]
        # How long each recv step waited in earlier runs, by step index (exec/resend.py).
        self.recv_times = resend.AnswerTimes()
        self.after_recv = {
            i: Stretch(self.steps, self.calls, i + 1, stop)
            for i, stop in zip(recvs, [*recvs[1:], len(self.steps)])
        }

    def footprint(self, store: ObjectStore, slots: list[int], params: dict) -> tuple:
        """(new bytes at the peak, work, {call step: (its new bytes and scratch, its work)})
        of all its steps, before a run (`Stretch.footprint`)."""
        return self.whole.footprint(store, slots, params)


class Stretch:
    """Steps of a program walked together on meta tensors (`_footprint`), from the stored
    values they read before they define them (`inputs`) and the run's parameters.

    A program's footprint is worked out over all its steps before it runs; the steps after
    a recv read what it received, so those up to the next recv are worked out again when it
    has stored that, and each of their calls is checked just before it runs (`Run.call`).
    A footprint is remembered per metadata of the inputs and parameters (FOOTPRINTS_KEPT):
    a replayed step receives the same layouts every time, and a meta run of each op costs
    more than most small ops do.
    """

    def __init__(self, steps: list, calls: dict[int, CompiledCall], start: int, stop: int) -> None:
        self.steps, self.calls, self.start, self.stop = steps, calls, start, stop
        defined: set[int] = set()
        self.inputs: list[int] = []  # slots read before these steps define them
        for step in steps[start:stop]:
            for slot in _reads(step):
                if slot not in defined and slot not in self.inputs:
                    self.inputs.append(slot)
            defined.update(_defines(step))
        # (input metas, params) -> (bytes at peak, work, {call step: (bytes, work)})
        self._footprints: OrderedDict[tuple, tuple] = OrderedDict()

    def footprint(self, store: ObjectStore, slots: list[int], params: dict) -> tuple:
        """(new bytes at the peak, work, {call step index: (new bytes and scratch, work)}).

        A call step missing from the dict depends on a transfer or on data: it is checked
        when it runs (`Run.check_footprint`)."""
        inputs = {s: store.get(slots[s]) for s in self.inputs if store.has(slots[s])}
        first: dict[int, int] = {}  # an input's tensor object -> the first input slot holding it
        key = (
            tuple((s, _meta_key(t)) for s, t in inputs.items()),
            tuple(first.setdefault(id(t), s) for s, t in inputs.items()),  # (see _footprint)
            tuple(sorted((i, _param_key(p)) for i, p in params.items())),
        )
        return _remembered(self._footprints, key, lambda: _footprint(self, inputs, params))


class CompiledCall:
    """A checked call step prepared to run: its op resolved from the allowlist, its
    arguments a template whose slot and parameter positions are filled per run.

    Nothing here is generated source: the op comes from `resolve` (the allowlist), and the
    slot and parameter indices filled in, which `_check_step` checked to be in range, are
    data (`slot_args`) or closed over (`fills`).
    """

    __slots__ = ("name", "op", "run", "resizes", "args", "kwargs", "slot_args", "fills",
                 "filled", "outs", "writes", "report", "n_returns", "one_out",
                 "threads_matter_from", "_footprints")  # fmt: skip

    def __init__(self, step: list) -> None:
        _, name, args, kwargs, outs, writes, report = step
        self.name = name
        self.op = resolve(name)
        self.run = runner(self.op)  # (session rng, args, kwargs) -> result; see ops.py
        self.resizes = resizes(self.op)  # it may grow its first argument's storage in place
        self.threads_matter_from = intraop.threads_matter_from(self.op)
        self.outs, self.writes, self.report = outs, writes, report
        self.n_returns = len(outs) - len(writes)
        # Its result, when a tensor, goes to one slot and nothing else changes (most calls):
        # a run stores it without the general path's unpacking (`Run.call`).
        self.one_out = len(outs) == 1 and not writes and not report and not self.resizes
        # The arguments that name a slot or parameter are filled in per run: (position,
        # slot) for a positional slot (most of them: filled in a loop, with no call each),
        # (position or keyword, filler) for the rest; the other arguments are constants,
        # shared with the template (see `_filler`).
        self.args = list(args)
        self.kwargs = dict(kwargs)
        self.slot_args = [(i, a.index) for i, a in enumerate(args) if type(a) is Slot]
        self.fills = [
            (i, _filler(a)) for i, a in enumerate(args) if type(a) is not Slot and _has_ref(a)
        ]
        self.fills += [(k, _filler(a)) for k, a in kwargs.items() if _has_ref(a)]
        self.filled = [i for i, _ in self.slot_args] + [where for where, _ in self.fills]
        # metadata of the arguments -> (new bytes, work) or None: see `footprint`
        self._footprints: OrderedDict[tuple, tuple[int, float] | None] = OrderedDict()

    def footprint(self, args: list, kwargs: dict) -> tuple[int, float] | None:
        """(bytes of new storage and scratch, work) of this call on these arguments, from a
        run on meta tensors (limits.op_footprint); None when meta cannot tell (data-dependent
        ops). Raises what its meta kernel raised when that refuses the arguments.

        Remembered per argument metadata (the FOOTPRINTS_KEPT last used), since a replayed
        step's steps that read transferred tensors see the same metadata every time and a
        meta run costs more than most small ops do."""
        try:  # (the constant arguments are the same every run: the filled ones tell)
            key = tuple([_meta_key(args[w] if type(w) is int else kwargs[w]) for w in self.filled])
            hash(key)
        except TypeError:  # an argument that does not hash: work it out every time
            return self._meta_footprint(args, kwargs)
        return _remembered(self._footprints, key, lambda: self._meta_footprint(args, kwargs))

    def _meta_footprint(self, args: list, kwargs: dict) -> tuple[int, float] | None:
        meta_args = [_to_meta(a) for a in args]
        meta_kw = {k: _to_meta(v) for k, v in kwargs.items()}
        result = op_footprint(self.op, meta_args, meta_kw)
        return None if result is None else _charged(result)

    def arguments(self, get: Any, slots: list[int], params: dict) -> tuple[list, dict]:
        """This call's (args, kwargs) for one run: `get(slots[slot])` gives a slot's tensor."""
        args, kwargs = self.args.copy(), self.kwargs.copy()
        for i, slot in self.slot_args:
            args[i] = get(slots[slot])
        for where, fill in self.fills:
            if type(where) is int:
                args[where] = fill(get, slots, params)
            else:
                kwargs[where] = fill(get, slots, params)
        return args, kwargs


def held_bytes(value: Any) -> int:
    """Bytes a decoded message value holds, roughly: each container its own size and a
    pointer per element, each string its length, and a prepared call step (its fillers
    and template) CALL_STEP_BYTES."""
    total, stack = 0, [value]
    while stack:
        v = stack.pop()
        t = type(v)
        if t is list or t is dict:
            total += 64 + 8 * len(v)
            stack.extend(v.values() if t is dict else v)
            if t is list and v and v[0] == "call":
                total += CALL_STEP_BYTES
        elif t is str or t is bytes:
            total += 49 + len(v)
        else:
            total += 32
    return total


def _charged(footprint: tuple) -> tuple[int, float]:
    """(new bytes and scratch, work) of an op's `limits.op_footprint`: what it is checked by."""
    _, made, scratch, work = footprint
    return sum(made.values()) + scratch, work


def _remembered(cache: OrderedDict, key: Any, work_out: Callable[[], Any]) -> Any:
    """`cache[key]`, from `work_out()` when missing; the FOOTPRINTS_KEPT entries last used
    stay (a program whose steps see a few layouts in turn keeps each of them)."""
    if key in cache:
        cache.move_to_end(key)
        return cache[key]
    value = cache[key] = work_out()
    if len(cache) > FOOTPRINTS_KEPT:
        cache.popitem(last=False)
    return value


def _has_ref(a: Any) -> bool:
    t = type(a)
    if t is Slot or t is Param:
        return True
    return t is list and any(_has_ref(x) for x in a)


def _filler(a: Any) -> Any:
    """A function (get, slots, params) -> the argument `a` names in one run (see
    `CompiledCall.arguments`)."""
    t = type(a)
    if t is Slot:
        index = a.index
        return lambda get, slots, params: get(slots[index])
    if t is Param:
        index = a.index
        return lambda get, slots, params: params[index]
    if t is list:
        parts = [_filler(x) for x in a]
        return lambda get, slots, params: [part(get, slots, params) for part in parts]
    # A constant, shared by every run: ATen copies the lists and numbers it is given and
    # never changes or keeps the Python objects.
    return lambda get, slots, params: a


def _param_key(p: Any) -> Any:
    """What of parameter `p` a footprint depends on: a tensor's layout (also in a list: a
    long tensor's repr is summarised, so two of different shapes can print alike)."""
    if isinstance(p, torch.Tensor):
        return ("tensor", p.shape, p.stride(), p.dtype)
    if isinstance(p, list):
        return ("list", *[_param_key(x) for x in p])
    return repr(p)


def _footprint(stretch: Stretch, inputs: dict[int, torch.Tensor], params: dict) -> tuple:
    """Run `stretch`'s steps on meta tensors: the peak of new bytes, the work, and each known
    call's new bytes (with its scratch) and work."""
    # Inputs that are one tensor object (an in-place op's result is stored under its own
    # value id and its input's) get one meta tensor: a layout change through one (as_strided_)
    # shows through the other, as it will when the program runs.
    same: dict[int, torch.Tensor] = {}  # id of an input's tensor object -> its meta tensor
    metas = {}
    for s, t in inputs.items():
        if id(t) not in same:
            same[id(t)] = meta_like(t)
        metas[s] = same[id(t)]
    meta_params = {i: _to_meta(p) for i, p in params.items()}  # (tensors in a list too)
    new_bytes: dict[int, int] = {}  # meta storage -> bytes, for storages this program makes
    users: dict[int, int] = {}  # meta storage -> slots naming it
    now = peak = 0
    work = 0.0
    ops: dict[int, tuple[int, float]] = {}

    def bind(slot: int, t: torch.Tensor | None) -> None:
        nonlocal now
        old = metas.pop(slot, None)
        if old is not None:
            key = old.untyped_storage()._cdata
            users[key] -= 1
            if users[key] == 0 and key in new_bytes:
                now -= new_bytes.pop(key)
        if t is not None:
            metas[slot] = t
            key = t.untyped_storage()._cdata
            users[key] = users.get(key, 0) + 1

    for t in metas.values():
        key = t.untyped_storage()._cdata
        users[key] = users.get(key, 0) + 1
    steps = stretch.steps
    for i in range(stretch.start, stretch.stop):
        step = steps[i]
        kind = step[0]
        if kind == "call":
            _, name, args, kwargs, outs, writes, _report = step
            known = all(type(r) is Param or r.index in metas for r in call_refs(step))
            footprint = None
            if known:
                resolved = [_meta_arg(a, metas, meta_params) for a in args]
                kw = {k: _meta_arg(v, metas, meta_params) for k, v in kwargs.items()}
                try:
                    footprint = op_footprint(stretch.calls[i].op, resolved, kw)
                except Exception:  # its meta kernel refused it: so is it, when it runs
                    footprint = None  # (`Run.check_footprint`), after the steps before it
            if footprint is None:  # depends on a transfer or on data: check when it runs
                for slot in [*outs, *(s for _, s in writes)]:
                    bind(slot, None)
                continue
            result, made, scratch, _ = footprint
            ops[i] = _charged(footprint)
            work += ops[i][1]
            for key, nbytes in made.items():
                if not users.get(key):  # (growth of a storage held already, by resize_, stays
                    new_bytes[key] = nbytes  # counted: values outside the run may hold it)
            now += sum(made.values())
            peak = max(peak, now + scratch)  # (scratch: freed by the time the op returns)
            tensors = _result_tensors(result)
            for slot, t in zip(outs, tensors):
                bind(slot, t)
            for path, slot in writes:
                t = _at_path(resolved, kw, path)
                bind(slot, t if isinstance(t, torch.Tensor) else None)
        elif kind == "recv":
            for slot in step[1]:
                bind(slot, None)  # counted when it arrives, against the inbox
        elif kind == "free":
            bind(step[1], None)
        elif kind == "return" and step[1] in metas:  # the reply holds a copy
            t = metas[step[1]]
            now += t.numel() * t.element_size()
            peak = max(peak, now)
    return peak, work, ops


def _meta_arg(a: Any, metas: dict, params: dict) -> Any:
    t = type(a)
    if t is Slot:
        return metas[a.index]
    if t is Param:
        return params[a.index]
    if t is list:
        return [_meta_arg(x, metas, params) for x in a]
    return a


def _result_tensors(result: Any) -> list[torch.Tensor]:
    if isinstance(result, torch.Tensor):
        return [result]
    if isinstance(result, (tuple, list)):
        return [r for r in result if isinstance(r, torch.Tensor)]
    return []


class Run:
    """One program's execution for one session on one worker."""

    def __init__(
        self, host: Host, session: Session, run: int, slots: list, params: dict,
        peers: dict[str, str], deadline: float,
    ) -> None:  # fmt: skip
        self.w = host
        self.s = session
        self.run = run
        self.slots = slots
        self.params = params
        self.peers = peers  # worker name -> the identity the client knows it by
        self.deadline = deadline
        self.created: list[int] = []  # value ids this run stored, undone on failure

    def value(self, slot: int) -> torch.Tensor:
        return self.s.store.get(self.slots[slot])

    def store(self, slot: int, tensor: Any) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise RequestError(f"slot {slot} would hold a {type(tensor).__name__}, not a tensor")
        vid = self.slots[slot]
        self.s.store.put(vid, tensor)
        self.created.append(vid)

    def execute(self, program: Program, checked: dict[int, tuple[int, float]]) -> dict:
        """Run `program`; `checked`: the footprints of the call steps its check before the
        run covered (`Program.footprint`)."""
        limits = self.w.limits
        check_memory = limits.max_client_memory is not None
        # Grad mode on, as where the client recorded the ops: no stored tensor requires grad,
        # so nothing is tracked, but some kernels read the mode (mkldnn_rnn_layer returns
        # no workspace without it, and nn.LSTM's backward needs that workspace).
        # (on a serving thread it is on already: then no context, one call instead of three)
        with nullcontext() if torch.is_grad_enabled() else torch.enable_grad():
            return self._execute(program, checked, limits, check_memory)

    def _execute(self, program: Program, checked: dict, limits: Limits, check_memory: bool) -> dict:
        returns, dynamic = [], []
        ahead: dict[int, tuple[int, float]] = {}  # footprints worked out after the last recv
        deadline = self.deadline
        for i, step in enumerate(program.steps):
            try:
                if time.monotonic() > deadline:
                    raise TimeLimitExceeded(limits.max_request_seconds)
                kind = step[0]
                if kind == "call":
                    report = self.call(program.calls[i], checked.get(i), ahead.get(i))
                    if report is not None:
                        dynamic.append(report)
                    if check_memory:  # a sum of running counts: no walk over the store
                        limits.check_memory(self.s.memory(), step[1])
                elif kind == "send":
                    self.send(step[1], step[2])
                elif kind == "recv":
                    self.recv(step[1], step[2], program.recv_times, i)
                    # the steps up to the next recv, from what is stored now (`Stretch`)
                    stretch = program.after_recv[i]
                    ahead = stretch.footprint(self.s.store, self.slots, self.params)[2]
                elif kind == "free":
                    self.s.store.free(self.slots[step[1]])
                elif kind == "return":
                    returns.append([step[1], self.value(step[1])])
            except Exception as e:
                return self.fail(program.steps, i, e)
        return {"returns": returns, "dynamic": dynamic}

    def call(self, call: CompiledCall, checked: tuple | None, ahead: tuple | None) -> list | None:
        """Run one call step. `checked`: its (new bytes, work), which the check before the
        run covered; else it is checked now, from `ahead` (worked out after the last recv)
        or, None too, from its arguments (`check_footprint`)."""
        resolved, kw = call.arguments(self.s.store.get, self.slots, self.params)
        if checked is not None:
            work = checked[1]
        else:  # its inputs came during the run, or from an op whose data sets its size
            work = self.check_footprint(call, ahead, resolved, kw)
        if work >= call.threads_matter_from:
            intraop.use_threads_for(work, call.threads_matter_from)
        result = call.run(self.s.rng, resolved, kw)
        if call.one_out and type(result) is torch.Tensor:  # the common case, as below
            check_bounds(result)
            self.s.ops_run += 1
            vid = self.slots[call.outs[0]]
            self.s.store.put(vid, result)
            self.created.append(vid)
            return None
        return self._take(call, resolved, kw, result)

    def _take(self, call: CompiledCall, resolved: list, kw: dict, result: Any) -> list | None:
        """Check and store what a call returned and wrote; its report, if it makes one."""
        name, outs, writes, report = call.name, call.outs, call.writes, call.report
        if call.resizes:  # counted at once: what follows may fail, the growth stays
            self.s.store.recount(resolved[0])
        check_view(result)
        self.s.ops_run += 1
        if isinstance(result, torch.Tensor):
            tensors, kind = [result], "tensor"
        elif isinstance(result, (tuple, list)) and all(
            isinstance(r, torch.Tensor) or r is None for r in result
        ):
            tensors = [r for r in result if r is not None]  # None: a gradient not asked for
            kind = "tuple" if isinstance(result, tuple) else "list"
        elif result is None:
            tensors, kind = [], "none"
        else:
            if not report:
                raise TypeError(f"{name} returned {type(result).__name__}, not tensors")
            if not isinstance(result, (bool, int, float, complex)):
                raise TypeError(f"{name} returned {type(result).__name__}")
            return [outs[0], "none", [], [result]]
        if len(tensors) > call.n_returns:
            raise RuntimeError(f"{name} returned {len(tensors)} tensors, expected {call.n_returns}")
        written = [(slot, _at_path(resolved, kw, path)) for path, slot in writes]
        for slot, t in zip(outs, tensors):
            self.store(slot, t)
        for slot, t in written:
            self.store(slot, t)
        if report:
            metas = [
                [
                    str(t.dtype).removeprefix("torch."),
                    list(t.shape),
                    list(t.stride()),
                    t.storage_offset(),
                ]
                for t in tensors
            ]
            return [outs[0], kind, metas, []]
        return None

    def check_footprint(
        self, call: CompiledCall, footprint: tuple | None, args: list, kwargs: dict
    ) -> float:
        """Check the call's new bytes, scratch and work (`footprint`, or worked out from its
        arguments) against the limits; return its work."""
        if footprint is None:
            footprint = call.footprint(args, kwargs)
        if footprint is None:  # its output size depends on its data: bounded from that
            footprint = data_dependent_footprint(call.op, args, kwargs)
        made, work = footprint
        limits = self.w.limits
        limits.check_memory(self.s.memory() + made, call.name)
        limits.check_work(work, call.name)
        return work

    def send(self, slots: list[int], dst: str) -> None:
        """Send the values in `slots` to worker `dst`, all in one transfer message."""
        self._transfer(slots, dst, tensors=[self.value(slot) for slot in slots])

    def _transfer(self, slots: list[int], dst: str, **body: Any) -> None:
        """Send worker `dst` the transfer message of the values in `slots`: their `tensors`,
        or an `error` in their place."""
        msg = {"kind": "transfer", "client": self.s.key, "run": self.run, "src": self.w.name,
               "values": [self.slots[slot] for slot in slots], **body}  # fmt: skip
        self.w.transfer(self.s, dst, self.peers[dst], msg)

    def recv(self, slots: list[int], src: str, times: resend.AnswerTimes, index: int) -> None:
        """Receive the values in `slots` from worker `src`, sent in one transfer message by
        the identity the run names for `src`; `times`: how long this recv step (`index`)
        waited in earlier runs, which says when to ask for the transfer again.

        The message must carry exactly these value ids, in this order, and a tensor for each:
        otherwise none of them is stored and the run fails."""
        vids = [self.slots[slot] for slot in slots]
        start = time.monotonic()
        deadline = min(start + self.w.recv_timeout, self.deadline)
        key, first_ask = (self.run, vids[0], src), times.wait(index, RESEND_AFTER)
        try:
            got = self.w.receive(self.s, key, self.peers[src], deadline, first_ask)
            times.observe(index, time.monotonic() - start)
        except TimeoutError:
            if time.monotonic() >= self.deadline:
                raise TimeLimitExceeded(self.w.limits.max_request_seconds) from None
            raise
        shown = ", ".join(f"%{v}" for v in vids)
        if got.get("error") is not None:
            raise UpstreamFailed(f"{shown} from {src}: {got.get('error')}")
        values, tensors = got.get("values"), got.get("tensors")
        if not (
            isinstance(values, list) and all(type(v) is int for v in values) and values == vids
        ):
            raise wire.WireError(f"transfer from {src} carried other values than {shown}")
        if not one_tensor_per_value(values, tensors):
            raise wire.WireError(f"transfer of {shown} from {src} lacks a tensor for each value")
        for slot, tensor in zip(slots, tensors):
            self.store(slot, tensor)

    def fail(self, steps: list, index: int, error: Exception) -> dict:
        """Report the failure, tell waiting workers, and undo what this run stored."""
        step = steps[index]
        for later in steps[index:]:
            if later[0] == "send":  # every value of the group waits for this one message
                self._transfer(later[1], later[2], error=f"failed on {self.w.name}")
        for vid in self.created:
            self.s.store.free(vid)
        upstream = isinstance(error, UpstreamFailed)
        if not upstream:
            log.warning(
                "%s: %s failed: %s", self.w.name, step[1] if step[0] == "call" else step[0], error
            )
        tb = traceback.format_exception_only(type(error), error)
        frames = traceback.extract_tb(error.__traceback__)[-3:]
        return {
            "ok": False,
            "error": {
                "worker": self.w.name,
                "op": step[1] if step[0] == "call" else step[0],
                "slot": step[4][0] if step[0] == "call" and step[4] else None,
                "message": "".join(tb).strip(),
                "traceback": "".join(traceback.format_list(frames)),
                "upstream": upstream,
                "code": getattr(error, "code", None),
            },
        }


def _meta_key(a: Any) -> Any:
    """What of argument `a` an op's footprint depends on: a tensor's layout, not its data."""
    if isinstance(a, torch.Tensor):
        storage = a.untyped_storage().nbytes()
        return (a.dtype, a.shape, a.stride(), a.storage_offset(), storage)
    if type(a) is list or type(a) is tuple:
        return tuple([_meta_key(x) for x in a])
    return (type(a), a)


def _to_meta(a: Any) -> Any:
    if isinstance(a, torch.Tensor):
        return meta_like(a)
    if isinstance(a, list):
        return [_to_meta(x) for x in a]
    return a


def _at_path(args: list, kwargs: dict, path: Any) -> Any:
    if isinstance(path, list):  # (argument, index in a tensor list)
        return _at_path(args, kwargs, path[0])[path[1]]
    return args[path] if type(path) is int else kwargs[path]


def _reads(step: list) -> list[int]:
    if step[0] == "call":
        return [r.index for r in call_refs(step) if type(r) is Slot]
    if step[0] == "send":
        return list(step[1])
    if step[0] in ("return", "free"):
        return [step[1]]
    return []


def _defines(step: list) -> list[int]:
    if step[0] == "call":
        return [*step[4], *(slot for _, slot in step[5])]
    if step[0] == "recv":
        return list(step[1])
    return []


def _check_step(step: Any, n_slots: int, params: set[int]) -> None:
    """Reject a malformed step before any step of its program runs."""
    if not isinstance(step, list) or not step or not isinstance(step[0], str):
        raise RequestError(f"malformed step {step!r:.80}")
    kind = step[0]
    if kind == "call":
        if (
            len(step) != 7
            or not isinstance(step[2], list)
            or not isinstance(step[3], dict)
            or not all(isinstance(k, str) for k in step[3])
            or not isinstance(step[4], list)
            or not isinstance(step[5], list)
        ):
            raise RequestError("a call step is [call, op, args, kwargs, outs, writes, report]")
        resolve(step[1])
        for ref in call_refs(step):
            if type(ref) is Param:
                params.add(ref.index)
            elif ref.index >= n_slots:
                raise RequestError(f"step refers to {ref!r}, beyond the program's values")
        if not all(type(s) is int and 0 <= s < n_slots for s in step[4]):
            raise RequestError("call outputs must be slots")
        for w in step[5]:
            if not (
                isinstance(w, list)
                and len(w) == 2
                and _is_path(w[0])
                and type(w[1]) is int
                and 0 <= w[1] < n_slots
                and w[1] in step[4]
            ):
                raise RequestError("call writes must be [argument path, output slot] pairs")
        if step[4] and len(step[4]) < len(step[5]):
            raise RequestError("a call writes more slots than it has outputs")
    elif kind in ("send", "recv"):
        if (
            len(step) != 3
            or not isinstance(step[1], list)
            or not step[1]
            or not all(type(s) is int for s in step[1])
            or not isinstance(step[2], str)
        ):
            raise RequestError(f"a {kind} step is [{kind}, [slot, ...], worker]")
        if not all(0 <= s < n_slots for s in step[1]):
            raise RequestError(f"{kind} of a slot beyond the program's values")
        if len(set(step[1])) != len(step[1]):
            raise RequestError(f"a {kind} step names a slot twice")
    elif kind in ("free", "return"):
        if len(step) != 2 or type(step[1]) is not int or not 0 <= step[1] < n_slots:
            raise RequestError(f"a {kind} step is [{kind}, slot]")
    else:
        raise RequestError(f"unknown step kind {kind!r}")


def _is_path(path: Any) -> bool:
    """An argument path: a position, a keyword, or [path, index] into a tensor list."""
    if type(path) is int:
        return path >= 0
    if isinstance(path, str):
        return True
    return isinstance(path, list) and len(path) == 2 and _is_path(path[0]) and type(path[1]) is int
