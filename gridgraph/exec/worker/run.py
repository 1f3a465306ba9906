"""Serving one request of a session: the handlers by kind, and `Run`, which runs a program.

`answer` runs where the session's workspace lives: in the worker (in-process) or in the
session's executor process, which the worker starts through an `Isolation`
(isolation/executor.py's); either reaches other workers through a `Host`.
A session's requests run one at a time, in order, on a thread of its own (worker.py starts
it), so one client's long program or blocked `recv` delays no other client.

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
import threading
import time
import traceback
from contextlib import nullcontext
from typing import Any, Protocol

import torch

from gridgraph.exec import resend, wire
from gridgraph.exec.protocol import MAX_CLIENT_KEY, MAX_NAME, UNKNOWN_PLAN, is_name
from gridgraph.exec.safety.limits import (
    LimitExceeded,
    Limits,
    TimeLimitExceeded,
    data_dependent_footprint,
)
from gridgraph.exec.worker import intraop
from gridgraph.exec.worker.ops import (
    check_bounds,
    check_view,
)
from gridgraph.exec.worker.prepare import CompiledCall, Program, at_path
from gridgraph.exec.worker.session import RequestError, Session
from gridgraph.schedule.program import Call, Free, Recv, Return, Send, Step
from gridgraph.trace.allowlist import OpRefused


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

    def heed_cancel(self, session: Session) -> None:
        """Take in a cancel (`Session.abort`) that its client sent since: a program checks
        between ops, at most every CANCEL_LOOK s (an executor reads it from its pipe)."""


class SessionExecutor(Protocol):
    """A process that holds one session's state and runs its requests (isolation/)."""

    lost: str | None  # why it ended, once it has

    def request(self, payload: bytes, held: int, worker: Any, session: Session) -> bytes:
        """Serve one request (`payload` as received); the reply, encoded."""

    def close(self) -> None:
        """End the process and free its place."""


class Isolation(Protocol):
    """How a worker runs each session's programs in a process of its own: isolation/'s
    `executor.Isolation`, which the worker's creator passes in (the worker never imports
    the isolation room, which runs this room's `answer` in its processes)."""

    def prewarm(self) -> None:
        """Get ready to start processes, in the background."""

    def start(
        self,
        worker: str,
        session: str,
        limits: Limits,
        recv_timeout: float,
        places: threading.BoundedSemaphore,
    ) -> SessionExecutor:
        """A process for `session`, in one of the worker's `places` (LimitExceeded if none
        is free)."""


log = logging.getLogger("gridgraph.worker")

# ipfs: PubSub drops messages: a recv waiting this long asks the sender to resend; sooner
# in a replayed program, whose earlier runs say how long the wait takes (exec/resend.py).
RESEND_AFTER = 0.5
# How often a running program looks for a cancel its client sent (`Host.heed_cancel`).
CANCEL_LOOK = 0.01


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


def checked_transfer_key(
    run: object, value: object, worker: object, client: object
) -> tuple[int, int, str] | None:
    """(run, value id, worker) of a transfer, or of an ask to resend one, from what its
    message says; None if that is no key: the ids must be ints (int() of an infinite one
    raised past the checks), the worker a name a run may name (the key is kept, and one no
    run may name would sit in an inbox unused), the client key a string of at most
    MAX_CLIENT_KEY characters."""
    if type(run) is not int or type(value) is not int or not is_name(worker):
        return None
    if not isinstance(client, str) or len(client) > MAX_CLIENT_KEY:
        return None
    return run, value, worker


def one_tensor_per_value(values: list, tensors: object) -> bool:
    """Whether a transfer's tensors match its value ids: one each, no id twice."""
    return (
        isinstance(tensors, list)
        and len(tensors) == len(values)
        and all(isinstance(t, torch.Tensor) for t in tensors)
        and all(type(v) is int for v in values)
        and len(set(values)) == len(values)
    )


class UpstreamFailed(Exception):
    """A value this worker waited for was never computed because its producer failed."""


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
        session.work.store.free(vid)


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
    after = session.memory() - session.work.store.bytes_freed_by(frees) + size
    host.limits.check_memory(after, "storing these tensors")
    _free(session, frees)
    for vid, tensor in values:
        session.work.store.put(vid, tensor)
    return {}


def _seed(host: Host, session: Session, msg: dict, frees: list[int], nbytes: int) -> dict:
    seed = msg.get("seed")
    if type(seed) is not int:
        raise RequestError("seed must be an int")
    session.work.rng.manual_seed(seed)
    _free(session, frees)
    return {}


def _stats(host: Host, session: Session, msg: dict, frees: list[int], nbytes: int) -> dict:
    _free(session, frees)
    out = {
        "objects": len(session.work.store),
        "stored_bytes": session.work.store.stored_bytes,
        "memory": session.memory(),
        "ops_run": session.work.ops_run,
        "messages": session.traffic.messages,
        "bytes": session.traffic.bytes,
    }
    if msg.get("reset"):
        session.traffic.reset()
        session.work.ops_run = 0
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
        program = session.work.programs.get(plan_id)
        if program is None:
            raise RequestError(f"unknown plan {plan_id}: send its program again", UNKNOWN_PLAN)
    if len(slots) != program.n_slots or not program.params <= params.keys():
        raise RequestError(f"run of plan {plan_id} does not fit its program")
    peers = _peers(msg.get("peers", {}), program, plan_id)
    # Checked from meta shapes before anything runs or changes; frees count as done.
    peak, work, checked = program.footprint(session.work.store, slots, params)
    held = session.memory() - session.work.store.bytes_freed_by(frees)
    if "program" in msg and plan_id not in session.work.programs:
        held += program.nbytes
    host.limits.check_memory(held + peak, f"run {run} (plan {plan_id})")
    host.limits.check_work(work, f"run {run} (plan {plan_id})")
    if "program" in msg:
        session.work.add_program(plan_id, program)
    session.work.programs.move_to_end(plan_id)
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
    return {"freed": session.work.store.clear()}  # in an executor; the worker forgets the rest


_HANDLERS = {"put": _put, "run": _run, "seed": _seed, "stats": _stats, "free": _ping,
             "ping": _ping, "bye": _bye}  # fmt: skip


class Run:
    """One program's execution for one session on one worker."""

    def __init__(
        self, host: Host, session: Session, run: int, slots: list, params: dict,
        peers: dict[str, str], deadline: float,
    ) -> None:  # fmt: skip
        self.w = host
        self.s = session
        self.work = session.work  # its tensors, random stream and ops count
        self.run = run
        self.slots = slots
        self.params = params
        self.peers = peers  # worker name -> the identity the client knows it by
        self.deadline = deadline
        self.created: list[int] = []  # value ids this run stored, undone on failure

    def value(self, slot: int) -> torch.Tensor:
        return self.work.store.get(self.slots[slot])

    def store(self, slot: int, tensor: Any) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise RequestError(f"slot {slot} would hold a {type(tensor).__name__}, not a tensor")
        vid = self.slots[slot]
        self.work.store.put(vid, tensor)
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
        session, host, look_at = self.s, self.w, 0.0
        for i, step in enumerate(program.steps):
            try:
                now = time.monotonic()
                if now > deadline:
                    raise TimeLimitExceeded(limits.max_request_seconds)
                if now >= look_at:
                    host.heed_cancel(session)
                    look_at = now + CANCEL_LOOK
                if session.aborted_upto and self.run <= session.aborted_upto:  # cancelled:
                    raise UpstreamFailed(
                        f"run {self.run} was cancelled by its client"
                    )  # (between ops)
                kind = type(step)
                if kind is Call:
                    report = self.call(program.calls[i], checked.get(i), ahead.get(i))
                    if report is not None:
                        dynamic.append(report)
                    if check_memory:  # a sum of running counts: no walk over the store
                        limits.check_memory(self.s.memory(), step.op)
                elif kind is Free:
                    self.work.store.free(self.slots[step.slot])
                elif kind is Send:
                    self.send(step.slots, step.worker)
                elif kind is Recv:
                    self.recv(step.slots, step.worker, program.recv_times, i)
                    # the steps up to the next recv, from what is stored now (`Stretch`)
                    stretch = program.after_recv[i]
                    ahead = stretch.footprint(self.work.store, self.slots, self.params)[2]
                elif kind is Return:
                    returns.append([step.slot, self.value(step.slot)])
            except Exception as e:
                return self.fail(program.steps, i, e)
        return {"returns": returns, "dynamic": dynamic}

    def call(self, call: CompiledCall, checked: tuple | None, ahead: tuple | None) -> list | None:
        """Run one call step. `checked`: its (new bytes, work), which the check before the
        run covered; else it is checked now, from `ahead` (worked out after the last recv)
        or, None too, from its arguments (`check_footprint`)."""
        resolved, kw = call.arguments(self.work.store.get, self.slots, self.params)
        if checked is not None:
            work = checked[1]
        else:  # its inputs came during the run, or from an op whose data sets its size
            work = self.check_footprint(call, ahead, resolved, kw)
        if work >= call.threads_matter_from:
            intraop.use_threads_for(work, call.threads_matter_from)
        result = call.run(self.work.rng, resolved, kw)
        if call.one_out and type(result) is torch.Tensor:  # the common case, as below
            check_bounds(result)
            self.work.ops_run += 1
            vid = self.slots[call.outs[0]]
            self.work.store.put(vid, result)
            self.created.append(vid)
            return None
        return self._take(call, resolved, kw, result)

    def _take(self, call: CompiledCall, resolved: list, kw: dict, result: Any) -> list | None:
        """Check and store what a call returned and wrote; its report, if it makes one."""
        name, outs, writes, report = call.name, call.outs, call.writes, call.report
        if call.resizes:  # counted at once: what follows may fail, the growth stays
            self.work.store.recount(resolved[0])
        check_view(result)
        self.work.ops_run += 1
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
        written = [(slot, at_path(resolved, kw, path)) for path, slot in writes]
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

    def fail(self, steps: list[Step], index: int, error: Exception) -> dict:
        """Report the failure, tell waiting workers, and undo what this run stored."""
        step = steps[index]
        for later in steps[index:]:
            if type(later) is Send:  # every value of the group waits for this one message
                self._transfer(later.slots, later.worker, error=f"failed on {self.w.name}")
        for vid in self.created:
            self.work.store.free(vid)
        upstream = isinstance(error, UpstreamFailed)
        what = step.op if type(step) is Call else step.kind
        if not upstream:
            log.warning("%s: %s failed: %s", self.w.name, what, error)
        tb = traceback.format_exception_only(type(error), error)
        frames = traceback.extract_tb(error.__traceback__)[-3:]
        return {
            "ok": False,
            "error": {
                "worker": self.w.name,
                "op": what,
                "slot": step.outs[0] if type(step) is Call and step.outs else None,
                "message": "".join(tb).strip(),
                "traceback": "".join(traceback.format_list(frames)),
                "upstream": upstream,
                "code": getattr(error, "code", None),
            },
        }
