"""The worker runtime: receives programs, runs them on its ObjectStore, replies.

State, all owned by the worker:
    store      tensors by (client, value id)
    inbox      values other workers sent for a run, by (client, run, value id)
    replies    the last replies sent, by request id, so a retried request is answered again
               and never run twice
    rng        its own random stream

Threads: the transport calls `on_message` (which only decodes and enqueues); one execution
thread takes requests in order and runs them. `recv` steps wait on the inbox, which the
transport fills directly, so a worker blocked in a recv still receives.

Every request is checked before anything runs: an undecodable, unknown or refused message
gets an error reply when it names a reply topic, is logged, and changes nothing.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
import traceback
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from gridgraph.exec import wire
from gridgraph.exec.ops import OpRefused, RandomState, resolve
from gridgraph.exec.store import ObjectStore
from gridgraph.exec.transport import Transport
from gridgraph.schedule.plan import Param, Slot, call_refs

log = logging.getLogger("gridgraph.worker")

DISCOVERY_TOPIC = "gridgraph.discovery"
PROGRAMS_KEPT = 64  # compiled programs a worker keeps per grid, least recently used dropped
# ipfs: PubSub drops messages (Kubo validates a peer's messages concurrently and ignores any
# whose seqno is below one already seen): a recv waiting this long asks the sender to resend.
RESEND_AFTER = 0.5
TRANSFERS_KEPT = 1024  # ipfs: recent transfers kept for resending, and received ones for dedup


def worker_topic(name: str) -> str:
    return f"gridgraph.worker.{name}"


class RequestError(Exception):
    """A request that cannot be served; its message goes back to the sender."""

    def __init__(self, message: str, code: str = "refused") -> None:
        super().__init__(message)
        self.code = code


class UpstreamFailed(Exception):
    """A value this worker waited for was never computed because its producer failed."""


class Worker:
    """A gridgraph worker on one transport endpoint."""

    def __init__(
        self,
        name: str,
        transport: Transport,
        *,
        recv_timeout: float = 120.0,
        peer_identity: Callable[[str], str | None] | None = None,
        peer_alive: Callable[[str], bool] = lambda name: True,
    ) -> None:
        self.name = name
        self.transport = transport
        self.store = ObjectStore()
        self.rng = RandomState()
        self.recv_timeout = recv_timeout
        # Maps a worker name to its transport identity, to check who sent a transfer.
        self.peer_identity = peer_identity or (lambda n: n)
        # Whether another worker still answers (heartbeats on IPFS): a recv from a dead one
        # fails at once instead of after recv_timeout, even if its client's abort was lost.
        self.peer_alive = peer_alive
        self.ops_run = 0
        self._inbox: dict[tuple[str, int, int], Any] = {}
        self._inbox_cv = threading.Condition()
        self._aborted: set[tuple[str, Any]] = set()  # (client, run) the client gave up on
        self._sent: OrderedDict[tuple, bytes] = OrderedDict()  # ipfs: (client, run, value, dst)
        self._received: OrderedDict[tuple, None] = OrderedDict()  # ipfs: consumed inbox keys
        self._queue: queue.Queue = queue.Queue()
        # ipfs: with the time each reply went out (-inf until it did)
        self._replies: OrderedDict[tuple[str, str], tuple[bytes, float]] = OrderedDict()
        self._programs: OrderedDict[tuple[str, int], _Program] = OrderedDict()
        self._last_seen: dict[str, float] = {}  # client identity -> time of last request
        self._closed = False
        self._handlers = {
            "put": self._put,
            "run": self._run,
            "free": lambda client, msg: {},  # _serve frees the ids every request carries
            "stats": self._stats,
            "seed": self._seed,
            "bye": self._bye,
            "ping": lambda client, msg: {},
        }
        transport.subscribe(worker_topic(name), self.on_message)
        self._thread = threading.Thread(target=self._loop, name=f"worker-{name}", daemon=True)
        self._thread.start()

    # --- receiving -------------------------------------------------------------------------

    def on_message(self, sender: str, payload: bytes) -> None:
        try:
            msg = wire.decode(payload)
        except wire.WireError as e:
            log.warning("%s: dropped a malformed message from %s: %s", self.name, sender, e)
            return
        kind = msg["kind"]
        if kind == "transfer":
            self._accept_transfer(sender, msg)
        elif kind == "resend":  # ipfs: a receiver missed a transfer
            self._resend(sender, msg)
        elif kind == "abort":  # handled here: the execution thread may be blocked in a recv
            with self._inbox_cv:
                self._aborted.add((_client_key(sender, msg), msg.get("run")))
                self._inbox_cv.notify_all()
        else:
            client, now = _client_key(sender, msg), time.monotonic()
            # Seen now, not when served: a request queued behind a long run keeps the lease.
            self._last_seen[client] = now
            self._queue.put((client, msg, now))  # ipfs: arrival

    def _accept_transfer(self, sender: str, msg: dict) -> None:
        try:
            key = (str(msg["client"]), int(msg["run"]), int(msg["value"]))
            src = str(msg["src"])
        except (KeyError, TypeError, ValueError):
            log.warning("%s: dropped a malformed transfer from %s", self.name, sender)
            return
        if self.peer_identity(src) != sender:
            log.warning("%s: dropped a transfer claiming to come from %s", self.name, src)
            return
        with self._inbox_cv:
            if key in self._received:  # ipfs: a resent copy of a transfer already used
                return
            self._inbox[key] = msg.get("tensor") if msg.get("error") is None else msg
            self._inbox_cv.notify_all()

    def _transfer(self, dst: str, msg: dict) -> None:
        """Send a transfer and keep it a while, in case the receiver asks again. # ipfs:"""
        payload = wire.encode(msg)
        self._sent[(msg["client"], msg["run"], msg["value"], dst)] = payload
        while len(self._sent) > TRANSFERS_KEPT:
            self._sent.popitem(last=False)
        self.transport.publish(worker_topic(dst), payload)

    def _resend(self, sender: str, msg: dict) -> None:  # ipfs:
        key = (msg.get("client"), msg.get("run"), msg.get("value"), msg.get("dst"))
        try:
            kept = self._sent.get(key)
        except TypeError:  # an unhashable field: not a request we sent
            return
        if kept is not None and self.peer_identity(str(key[3])) == sender:
            self.transport.publish(worker_topic(key[3]), kept, counted=False)

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            sender, msg, arrived = item
            try:
                self._serve(sender, msg, arrived)
            except Exception:  # a bug must not take the worker down
                log.exception("%s: failed to serve %s", self.name, msg.get("kind"))

    def _serve(self, client: str, msg: dict, arrived: float = math.inf) -> None:
        rid = msg.get("id")
        reply_to = msg.get("reply_to")
        if not isinstance(reply_to, str) or not isinstance(rid, str):
            log.warning("%s: dropped a %r request without id or reply_to", self.name, msg["kind"])
            return
        cached = self._replies.get((client, rid))
        if cached is not None:  # a retry: answer again, never run twice
            reply, sent_at = cached
            # ipfs: a copy that came before the reply went out needs no other answer; only
            # later ones mean the reply was lost (so clients can retry often, at no cost)
            if arrived > sent_at:
                self.transport.publish(reply_to, reply, counted=False)  # ipfs: a recovery
            return
        handler = self._handlers.get(msg["kind"])
        try:
            if handler is None:
                raise RequestError(f"unknown request kind {msg['kind']!r}")
            self._free_ids(client, msg.get("free", []))
            body = {"ok": True, **handler(client, msg)}
        except (RequestError, wire.WireError, OpRefused) as e:
            log.warning("%s: refused a %r request from %s: %s", self.name, msg["kind"], client, e)
            code = getattr(e, "code", "refused")
            body = {"ok": False, "error": {"worker": self.name, "message": str(e), "code": code}}
        reply = wire.encode({"kind": "reply", "re": rid, "worker": self.name, **body})
        self._replies[(client, rid)] = (reply, -math.inf)
        while len(self._replies) > 256:
            self._replies.popitem(last=False)
        self.transport.publish(reply_to, reply, counted=msg["kind"] != "stats")
        self._replies[(client, rid)] = (reply, time.monotonic())  # ipfs: it went out

    # --- requests --------------------------------------------------------------------------

    def _put(self, client: str, msg: dict) -> dict:
        values = _list(msg, "values")
        checked = []
        for item in values:
            if not (
                isinstance(item, list)
                and len(item) == 2
                and type(item[0]) is int
                and isinstance(item[1], torch.Tensor)
            ):
                raise RequestError("put values must be [value id, tensor] pairs")
            checked.append(item)
        for vid, tensor in checked:
            self.store.put(client, vid, tensor)
        return {}

    def _free_ids(self, client: str, ids: Any) -> None:
        if not isinstance(ids, list) or not all(type(v) is int for v in ids):
            raise RequestError("'free' must be a list of value ids")
        for vid in ids:
            self.store.free(client, vid)

    def _seed(self, client: str, msg: dict) -> dict:
        seed = msg.get("seed")
        if type(seed) is not int:
            raise RequestError("seed must be an int")
        self.rng.manual_seed(seed)
        return {}

    def _stats(self, client: str, msg: dict) -> dict:
        sent = self.transport.sent
        out = {
            "objects": len(self.store),
            "stored_bytes": self.store.stored_bytes(),
            "ops_run": self.ops_run,
            "messages": sent.messages,
            "bytes": sent.bytes,
        }
        if msg.get("reset"):
            sent.reset()
            self.ops_run = 0
        return out

    def _bye(self, client: str, msg: dict) -> dict:
        n = self._forget_client(client)
        return {"freed": n}

    def _forget_client(self, client: str) -> int:
        for key in [k for k in self._programs if k[0] == client]:
            del self._programs[key]
        n = self.store.free_client(client)
        self._last_seen.pop(client, None)
        log.info("%s: client %s left, freed %d tensors", self.name, client, n)
        return n

    def expire_clients(self, lease: float) -> None:
        """Free the tensors of clients silent for longer than `lease` seconds."""
        now = time.monotonic()
        for client in self.store.clients():
            seen = self._last_seen.setdefault(client, now)
            if now - seen > lease:
                log.info("%s: lease of client %s expired", self.name, client)
                self._forget_client(client)

    # --- running a program -----------------------------------------------------------------

    def _run(self, client: str, msg: dict) -> dict:
        run, plan_id, slots = msg.get("run"), msg.get("plan"), msg.get("slots")
        params = msg.get("params")
        if type(run) is not int or type(plan_id) is not int or not isinstance(slots, list):
            raise RequestError("a run needs 'run', 'plan' and 'slots'")
        if not all(type(v) is int for v in slots):
            raise RequestError("slots must be value ids")
        if not isinstance(params, list) or not all(
            isinstance(p, list) and len(p) == 2 and type(p[0]) is int for p in params
        ):
            raise RequestError("params must be [index, value] pairs")
        params = dict(params)
        if "program" in msg:
            self._programs[(client, plan_id)] = _Program(msg["program"], len(slots))
            while len(self._programs) > PROGRAMS_KEPT:
                self._programs.popitem(last=False)
        program = self._programs.get((client, plan_id))
        if program is None:
            raise RequestError(f"unknown plan {plan_id}: send its program again", "unknown-plan")
        self._programs.move_to_end((client, plan_id))
        if len(slots) != program.n_slots or not program.params <= params.keys():
            raise RequestError(f"run of plan {plan_id} does not fit its program")
        return _Run(self, client, run, slots, params).execute(program.steps)

    def close(self) -> None:
        self._closed = True
        self._queue.put(None)
        self.transport.close()
        self._thread.join(timeout=5)


class _Program:
    """A checked program: every step well-formed, every slot and parameter in range."""

    def __init__(self, stages: Any, n_slots: int) -> None:
        if not isinstance(stages, list) or not all(isinstance(st, list) for st in stages):
            raise RequestError("a program is a list of stages, each a list of steps")
        self.steps = [step for stage in stages for step in stage]
        self.n_slots = n_slots
        self.params: set[int] = set()
        for step in self.steps:
            _check_step(step, n_slots, self.params)


class _Run:
    """One program's execution on one worker."""

    def __init__(self, worker: Worker, client: str, run: int, slots: list, params: list):
        self.w = worker
        self.client = client
        self.run = run
        self.slots = slots
        self.params = params
        self.created: list[int] = []  # value ids this run stored, undone on failure

    def value(self, slot: int) -> torch.Tensor:
        return self.w.store.get(self.client, self.slots[slot])

    def arg(self, a: Any) -> Any:
        t = type(a)
        if t is Slot:
            return self.value(a.index)
        if t is Param:
            return self.params[a.index]
        if t is list:
            return [self.arg(x) for x in a]
        return a

    def store(self, slot: int, tensor: torch.Tensor) -> None:
        vid = self.slots[slot]
        self.w.store.put(self.client, vid, tensor)
        self.created.append(vid)

    def execute(self, steps: list) -> dict:
        returns, dynamic = [], []
        for i, step in enumerate(steps):
            try:
                kind = step[0]
                if kind == "call":
                    report = self.call(step)
                    if report is not None:
                        dynamic.append(report)
                elif kind == "send":
                    self.send(step[1], step[2])
                elif kind == "recv":
                    self.recv(step[1], step[2])
                elif kind == "free":
                    self.w.store.free(self.client, self.slots[step[1]])
                elif kind == "return":
                    returns.append([step[1], self.value(step[1])])
            except Exception as e:
                return self.fail(steps, i, e)
        return {"returns": returns, "dynamic": dynamic}

    def call(self, step: list) -> list | None:
        _, name, args, kwargs, outs, writes, report = step
        op = resolve(name)
        resolved = [self.arg(a) for a in args]
        kw = {k: self.arg(v) for k, v in kwargs.items()}
        # Grad mode on, as where the client recorded the op: no stored tensor requires grad,
        # so nothing is tracked, but some kernels read the mode (mkldnn_rnn_layer returns
        # no workspace without it, and nn.LSTM's backward needs that workspace).
        with torch.enable_grad():
            result = self.w.rng.call(op, resolved, kw)
        self.w.ops_run += 1
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
            return [outs[0], "none", [], [result]]
        n_returns = len(outs) - len(writes)
        if len(tensors) > n_returns:
            raise RuntimeError(f"{name} returned {len(tensors)} tensors, expected {n_returns}")
        for slot, t in zip(outs, tensors):
            self.store(slot, t)
        for path, slot in writes:
            self.store(slot, _at_path(resolved, kw, path))
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

    def send(self, slot: int, dst: str) -> None:
        msg = {
            "kind": "transfer",
            "client": self.client,
            "run": self.run,
            "value": self.slots[slot],
            "src": self.w.name,
            "tensor": self.value(slot),
        }
        self.w._transfer(dst, msg)

    def recv(self, slot: int, src: str) -> None:
        vid = self.slots[slot]
        key = (self.client, self.run, vid)
        deadline = time.monotonic() + self.w.recv_timeout
        wait = RESEND_AFTER
        ask = time.monotonic() + wait
        with self.w._inbox_cv:
            while key not in self.w._inbox:
                if (self.client, self.run) in self.w._aborted:
                    raise UpstreamFailed(f"run {self.run} was aborted by its client")
                if not self.w.peer_alive(src):
                    raise UpstreamFailed(f"worker {src} stopped answering")
                now = time.monotonic()
                if now >= deadline:
                    raise TimeoutError(f"timed out waiting for %{vid} from worker {src}")
                if now >= ask:  # ipfs: maybe dropped; the sender resends it if it was sent
                    resend = {"kind": "resend", "client": self.client, "run": self.run,
                              "value": vid, "dst": self.w.name}  # fmt: skip
                    self.w.transport.publish(worker_topic(src), wire.encode(resend), False)
                    wait = min(2 * wait, 8 * RESEND_AFTER)  # ipfs: slow, or lost again
                    ask = now + wait
                self.w._inbox_cv.wait(min(deadline, ask) - now)
            got = self.w._inbox.pop(key)
            self.w._received[key] = None  # ipfs: ignore resent copies of it
            while len(self.w._received) > TRANSFERS_KEPT:
                self.w._received.popitem(last=False)
        if isinstance(got, dict):
            raise UpstreamFailed(f"%{vid} from {src}: {got.get('error')}")
        if not isinstance(got, torch.Tensor):
            raise wire.WireError(f"transfer of %{vid} from {src} carried no tensor")
        self.store(slot, got)

    def fail(self, steps: list, index: int, error: Exception) -> dict:
        """Report the failure, tell waiting workers, and undo what this run stored."""
        step = steps[index]
        for later in steps[index:]:
            if later[0] == "send":
                msg = {
                    "kind": "transfer",
                    "client": self.client,
                    "run": self.run,
                    "value": self.slots[later[1]],
                    "src": self.w.name,
                    "error": f"failed on {self.w.name}",
                }
                self.w._transfer(later[2], msg)
        for vid in self.created:
            self.w.store.free(self.client, vid)
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
            },
        }


def _client_key(sender: str, msg: dict) -> str:
    """Who owns the tensors a request names: the sender's identity and its session."""
    session = msg.get("session")
    return f"{sender}/{session}" if isinstance(session, str) else sender


def _at_path(args: list, kwargs: dict, path: Any) -> Any:
    if isinstance(path, list):  # (argument, index in a tensor list)
        return _at_path(args, kwargs, path[0])[path[1]]
    return args[path] if type(path) is int else kwargs[path]


def _list(msg: dict, key: str) -> list:
    v = msg.get(key)
    if not isinstance(v, list):
        raise RequestError(f"{key!r} must be a list")
    return v


def _check_step(step: Any, n_slots: int, params: set[int]) -> None:
    """Reject a malformed step before any step of its program runs."""
    if not isinstance(step, list) or not step or not isinstance(step[0], str):
        raise RequestError(f"malformed step {step!r:.80}")
    kind = step[0]
    if kind == "call":
        if len(step) != 7 or not isinstance(step[2], list) or not isinstance(step[3], dict):
            raise RequestError("a call step is [call, op, args, kwargs, outs, writes, report]")
        resolve(step[1])
        for ref in call_refs(step):
            if type(ref) is Param:
                params.add(ref.index)
            elif ref.index >= n_slots:
                raise RequestError(f"step refers to {ref!r}, beyond the program's values")
        if not all(type(s) is int and 0 <= s < n_slots for s in step[4]):
            raise RequestError("call outputs must be slots")
    elif kind in ("send", "recv"):
        if len(step) != 3 or type(step[1]) is not int or not isinstance(step[2], str):
            raise RequestError(f"a {kind} step is [{kind}, slot, worker]")
        if not 0 <= step[1] < n_slots:
            raise RequestError(f"{kind} of slot {step[1]} beyond the program's values")
    elif kind in ("free", "return"):
        if len(step) != 2 or type(step[1]) is not int or not 0 <= step[1] < n_slots:
            raise RequestError(f"a {kind} step is [{kind}, slot]")
    else:
        raise RequestError(f"unknown step kind {kind!r}")
