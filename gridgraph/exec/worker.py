"""The worker runtime: receives requests, runs each client's programs, replies.

Threat model: a worker on an open grid serves peers it has never met, and any peer can send
it anything. So every message is hostile until checked, and nothing one client sends may
read or change another client's data, crash the worker, or stall other clients.

State:
    sessions   client key -> Session (session.py): everything kept for one client. A client
               is the authenticated sender (`sender`, the transport's identity) plus the
               session id it chose; each peer may hold `limits.sessions_per_peer` of them
    closed     client keys that said `bye` (the latest CLOSED_KEPT): their late requests are
               refused, not run on a fresh session
    rate       a token bucket per peer (limits.py)

Policy:
    - The transport's thread only decodes, checks and enqueues (`on_message`); it never
      blocks and never runs a request. Messages over `limits.max_message_bytes` are dropped.
    - Each session's requests run one at a time in arrival order on a thread of its own, so
      one client's long program, or a `recv` that waits, delays no other client.
    - Exactly once: a request id runs at most once per session (the session's records).
      A resend of a request that is queued or running is ignored; one that already has its
      reply gets that reply again. Every accepted request gets exactly one reply: an error
      reply if anything fails, including encoding the reply itself.
    - A refused request changes nothing, not even its `free` list: frees apply only once the
      request was accepted and served. A request over the peer's rate, the session's memory
      or time limit is refused with an error naming the limit (limits.py).
    - A malformed request gets an error reply when it names a reply topic and an id.
    - Transfers from other workers are accepted only from the worker they name (checked
      against `peer_identity`, which must not block) into the inbox of the session they
      name, counted against that session's memory.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

import torch

from gridgraph.exec import wire
from gridgraph.exec.limits import LimitExceeded, Limits, RateLimiter
from gridgraph.exec.ops import OpRefused
from gridgraph.exec.session import Program, RequestError, Run, Session
from gridgraph.exec.transport import Transport

log = logging.getLogger("gridgraph.worker")

DISCOVERY_TOPIC = "gridgraph.discovery"
CLOSED_KEPT = 4096  # session keys that said bye, remembered to refuse their late requests
REQUEST_KINDS = frozenset({"put", "run", "free", "stats", "seed", "bye", "ping"})


def worker_topic(name: str) -> str:
    return f"gridgraph.worker.{name}"


class Worker:
    """A gridgraph worker on one transport endpoint."""

    def __init__(
        self,
        name: str,
        transport: Transport,
        *,
        limits: Limits | None = None,
        recv_timeout: float = 120.0,
        peer_identity: Callable[[str], str | None] | None = None,
        peer_alive: Callable[[str], bool] = lambda name: True,
    ) -> None:
        self.name = name
        self.transport = transport
        self.limits = limits or Limits()
        self.recv_timeout = recv_timeout
        # Maps a worker name to its transport identity, to check who sent a transfer. It is
        # called on the transport's thread, so it must answer at once (None: unknown yet).
        self.peer_identity = peer_identity or (lambda n: n)
        # Whether another worker still answers (heartbeats on IPFS): a recv from a dead one
        # fails at once instead of after recv_timeout, even if its client's abort was lost.
        self.peer_alive = peer_alive
        self.sessions: dict[str, Session] = {}
        self._closed_sessions: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()  # guards sessions and _closed_sessions
        self._rate = RateLimiter(self.limits.requests_per_second, self.limits.request_burst)
        # Publications decided on the transport's thread go out from this one thread.
        self._outbox: queue.Queue = queue.Queue()
        self._closed = False
        self._handlers = {
            "put": self._put,
            "run": self._run,
            "free": lambda s, msg, frees, nbytes: self._free(s, frees) or {},
            "stats": self._stats,
            "seed": self._seed,
            "bye": self._bye,
            "ping": lambda s, msg, frees, nbytes: self._free(s, frees) or {},
        }
        self._sender = threading.Thread(target=self._send_loop, name=f"{name}-out", daemon=True)
        self._sender.start()
        transport.subscribe(worker_topic(name), self.on_message)

    # --- receiving (the transport's thread: check, enqueue, never block) -------------------

    def on_message(self, sender: str, payload: bytes) -> None:
        if len(payload) > self.limits.max_message_bytes:
            log.warning("%s: dropped a %d-byte message from %s, over the limit of %d",
                        self.name, len(payload), sender, self.limits.max_message_bytes)  # fmt: skip
            return
        try:
            msg = wire.decode(payload)
        except wire.WireError as e:
            log.warning("%s: dropped a malformed message from %s: %s", self.name, sender, e)
            return
        try:
            kind = msg["kind"]
            if kind == "transfer":
                self._accept_transfer(sender, msg, len(payload))
            elif kind == "resend":  # ipfs: a receiver missed a transfer
                self._resend(sender, msg)
            elif kind == "abort":  # the session's thread may be blocked in a recv
                session = self._session(_client_key(sender, msg), sender, create=False)
                if session is not None:
                    session.abort(msg.get("run"))
            else:
                self._accept_request(sender, msg, len(payload))
        except Exception:  # a bug must not take the transport's thread down
            log.exception("%s: failed to accept a message from %s", self.name, sender)

    def _accept_request(self, sender: str, msg: dict, nbytes: int) -> None:
        rid, reply_to = msg.get("id"), msg.get("reply_to")
        if not isinstance(reply_to, str) or not isinstance(rid, str):
            log.warning("%s: dropped a %r request without id or reply_to", self.name, msg["kind"])
            return
        arrived = time.monotonic()
        key = _client_key(sender, msg)
        try:
            session = self._session(key, sender, create=msg["kind"] != "bye")
        except (RequestError, LimitExceeded) as e:
            self._refuse(reply_to, rid, e)
            return
        if session is None:  # a bye for a session that is gone: nothing left to free
            self._outbox.put((reply_to, self._encode_reply(rid, {"ok": True, "freed": 0})))
            return
        with session.cv:
            session.last_seen = arrived  # seen now, not when served: a queued request keeps
            rec = session.records.get(rid)  # the lease
            if rec is not None:  # a resend: never run twice
                if rec.reply is not None and arrived > rec.sent_at:  # the reply was lost
                    self._outbox.put((reply_to, rec.reply))
                elif rec.reply is None and rec.sent_at < arrived:
                    error = RequestError("request already served; its reply is no longer kept",
                                         "already-served")  # fmt: skip
                    self._refuse(reply_to, rid, error)
                return
            if msg["kind"] not in REQUEST_KINDS:
                error = RequestError(f"unknown request kind {msg['kind']!r}")
            elif not self._rate.allow(sender):
                error = LimitExceeded(
                    f"over the rate limit of {self.limits.requests_per_second:g} requests a "
                    f"second per peer (requests_per_second)"
                )
            else:
                error = None
            rec = session.record(rid)  # a refusal is an answer too: recorded like one
            if error is not None:
                log.warning("%s: refused a %r request from %s: %s", self.name, msg["kind"], key,
                            error)  # fmt: skip
                reply = self._error_reply(rid, error)
                session.replied(rec, reply)
                rec.sent_at = arrived
                self._outbox.put((reply_to, reply))
                return
            session.queue.append((msg, arrived, nbytes))
            if session.busy:
                return
            session.busy = True
        threading.Thread(
            target=self._drain, args=(session,), name=f"{self.name}-{key[-12:]}", daemon=True
        ).start()

    def _session(self, key: str, peer: str, create: bool) -> Session | None:
        with self._lock:
            session = self.sessions.get(key)
            if session is not None or not create:
                return session
            if key in self._closed_sessions:
                raise RequestError("this session has ended (bye); start a new one", "closed")
            if sum(s.peer == peer for s in self.sessions.values()) >= (
                self.limits.sessions_per_peer
            ):
                raise LimitExceeded(
                    f"this peer already holds {self.limits.sessions_per_peer} sessions here "
                    "(sessions_per_peer)"
                )
            session = self.sessions[key] = Session(key, peer)
            return session

    def _accept_transfer(self, sender: str, msg: dict, nbytes: int) -> None:
        try:
            key = (int(msg["run"]), int(msg["value"]), str(msg["src"]))
            client = str(msg["client"])
        except (KeyError, TypeError, ValueError):
            log.warning("%s: dropped a malformed transfer from %s", self.name, sender)
            return
        if self.peer_identity(key[2]) != sender:
            log.warning("%s: dropped a transfer claiming to come from %s", self.name, key[2])
            return
        session = self._session(client, client.split("/", 1)[0], create=False)
        if session is None:
            session = self._transfer_session(client)
            if session is None:
                return
        item = msg.get("tensor") if msg.get("error") is None else msg
        if not isinstance(item, (torch.Tensor, dict)):
            item = {"error": "a transfer must carry a tensor or an error"}
        cap = self.limits.max_client_memory
        if cap is not None and session.memory() + nbytes > cap:
            item = {"error": f"over the client's memory limit of {cap} bytes (max_client_memory)"}
        session.deliver(key, item, nbytes)

    def _transfer_session(self, client: str) -> Session | None:
        """The session a transfer names, created if its peer may hold one more."""
        try:
            return self._session(client, client.split("/", 1)[0], create=True)
        except (RequestError, LimitExceeded) as e:
            log.warning("%s: dropped a transfer for %s: %s", self.name, client, e)
            return None

    def _resend(self, sender: str, msg: dict) -> None:  # ipfs:
        try:
            key = (int(msg["run"]), int(msg["value"]), str(msg["dst"]))
            client = str(msg["client"])
        except (KeyError, TypeError, ValueError):
            return
        session = self._session(client, "", create=False)
        kept = session.sent.get(key) if session is not None else None
        if kept is not None and self.peer_identity(key[2]) == sender:
            self._outbox.put((worker_topic(key[2]), kept))

    def _send_loop(self) -> None:
        while True:
            item = self._outbox.get()
            if item is None:
                return
            topic, payload = item
            try:
                self.transport.publish(topic, payload, counted=False)  # ipfs: a recovery
            except Exception as e:
                log.warning("%s: could not send to %s: %s", self.name, topic, e)

    # --- serving (one thread per busy session) ---------------------------------------------

    def _drain(self, session: Session) -> None:
        while True:
            with session.cv:
                if not session.queue or session.closed:
                    session.busy = False
                    return
                msg, arrived, nbytes = session.queue.popleft()
            try:
                self._serve(session, msg, nbytes)
            except Exception:  # a bug must not take the worker down
                log.exception("%s: failed to serve %s", self.name, msg.get("kind"))

    def _serve(self, session: Session, msg: dict, nbytes: int = 0) -> None:
        rid, kind = msg["id"], msg["kind"]
        try:
            frees = msg.get("free", [])
            if not isinstance(frees, list) or not all(type(v) is int for v in frees):
                raise RequestError("'free' must be a list of value ids")
            body = {"ok": True, **self._handlers[kind](session, msg, frees, nbytes)}
        except (RequestError, wire.WireError, OpRefused, LimitExceeded) as e:
            log.warning("%s: refused a %r request from %s: %s", self.name, kind, session.key, e)
            body = _error_body(self.name, e)
        except Exception as e:  # a bug, or a failure outside a program: still one reply
            log.exception("%s: %r request from %s failed", self.name, kind, session.key)
            body = _error_body(self.name, e)
        reply = self._encode_reply(rid, body)
        if kind == "bye":
            self._publish(session, msg["reply_to"], reply, counted=True)
            return
        with session.cv:
            rec = session.records.get(rid)
            if rec is not None:
                session.replied(rec, reply)
        self._publish(session, msg["reply_to"], reply, counted=kind != "stats")
        if rec is not None:
            rec.sent_at = time.monotonic()

    def _encode_reply(self, rid: str, body: dict) -> bytes:
        try:
            return wire.encode({"kind": "reply", "re": rid, "worker": self.name, **body})
        except Exception as e:  # a result that cannot be sent: the client still hears why
            log.warning("%s: could not encode the reply to %s: %s", self.name, rid, e)
            error = _error_body(self.name, RequestError(f"the reply could not be encoded: {e}"))
            return wire.encode({"kind": "reply", "re": rid, "worker": self.name, **error})

    def _error_reply(self, rid: str, error: Exception) -> bytes:
        return self._encode_reply(rid, _error_body(self.name, error))

    def _refuse(self, reply_to: str, rid: str, error: Exception) -> None:
        """An error reply decided on the transport's thread (nothing recorded, nothing run)."""
        log.warning("%s: refused request %s: %s", self.name, rid, error)
        self._outbox.put((reply_to, self._error_reply(rid, error)))

    def _publish(self, session: Session, topic: str, payload: bytes, counted: bool) -> None:
        if counted:
            session.traffic.add(len(payload))
        try:
            self.transport.publish(topic, payload, counted)
        except Exception as e:  # the transport is closing, or the node is down
            log.warning("%s: could not send to %s: %s", self.name, topic, e)

    # --- requests --------------------------------------------------------------------------

    def _free(self, session: Session, frees: list[int]) -> None:
        for vid in frees:
            session.store.free(vid)

    def _put(self, session: Session, msg: dict, frees: list[int], nbytes: int) -> dict:
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
        self.limits.check_memory(after, "storing these tensors")
        self._free(session, frees)
        for vid, tensor in values:
            session.store.put(vid, tensor)
        return {}

    def _seed(self, session: Session, msg: dict, frees: list[int], nbytes: int) -> dict:
        seed = msg.get("seed")
        if type(seed) is not int:
            raise RequestError("seed must be an int")
        session.rng.manual_seed(seed)
        self._free(session, frees)
        return {}

    def _stats(self, session: Session, msg: dict, frees: list[int], nbytes: int) -> dict:
        self._free(session, frees)
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

    def _bye(self, session: Session, msg: dict, frees: list[int], nbytes: int) -> dict:
        return {"freed": self._forget(session)}

    def _forget(self, session: Session) -> int:
        with self._lock:
            if self.sessions.get(session.key) is session:
                del self.sessions[session.key]
            self._closed_sessions[session.key] = None
            while len(self._closed_sessions) > CLOSED_KEPT:
                self._closed_sessions.popitem(last=False)
        n = session.close()
        log.info("%s: client %s left, freed %d tensors", self.name, session.key, n)
        return n

    def expire_clients(self, lease: float) -> None:
        """Free everything of clients silent for longer than `lease` seconds."""
        now = time.monotonic()
        with self._lock:
            silent = [s for s in self.sessions.values() if now - s.last_seen > lease]
        for session in silent:
            if not session.busy:
                log.info("%s: lease of client %s expired", self.name, session.key)
                with self._lock:
                    self.sessions.pop(session.key, None)
                session.close()

    def _run(self, session: Session, msg: dict, frees: list[int], nbytes: int) -> dict:
        start = time.monotonic()
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
            program = Program(msg["program"], len(slots), nbytes)
        else:
            program = session.programs.get(plan_id)
            if program is None:
                raise RequestError(
                    f"unknown plan {plan_id}: send its program again", "unknown-plan"
                )
        if len(slots) != program.n_slots or not program.params <= params.keys():
            raise RequestError(f"run of plan {plan_id} does not fit its program")
        # Checked from meta shapes before anything runs or changes; frees count as done.
        peak, work, unchecked = program.footprint(session.store, slots, params)
        held = session.memory() - session.store.bytes_freed_by(frees)
        if "program" in msg and plan_id not in session.programs:
            held += program.nbytes
        self.limits.check_memory(held + peak, f"run {run} (plan {plan_id})")
        self.limits.check_work(work, f"run {run} (plan {plan_id})")
        if "program" in msg:
            session.add_program(plan_id, program)
        session.programs.move_to_end(plan_id)
        self._free(session, frees)
        deadline = self.limits.deadline(start)
        return Run(self, session, run, slots, params, deadline).execute(program, unchecked)

    # --- transfers between workers (called by Run) -----------------------------------------

    def transfer(self, session: Session, dst: str, msg: dict) -> None:
        """Send a transfer and keep it a while, in case the receiver asks again. # ipfs:"""
        payload = wire.encode(msg)
        session.keep_sent((msg["run"], msg["value"], dst), payload)
        self._publish(session, worker_topic(dst), payload, counted=True)

    def ask_resend(self, session: Session, run: int, vid: int, src: str) -> None:
        """ipfs: ask worker `src` to send a transfer again (it may have been dropped)."""
        resend = {"kind": "resend", "client": session.key, "run": run, "value": vid,
                  "dst": self.name}  # fmt: skip
        self._outbox.put((worker_topic(src), wire.encode(resend)))

    def close(self) -> None:
        self._closed = True
        self.transport.close()
        self._outbox.put(None)
        with self._lock:
            sessions = list(self.sessions.values())
            self.sessions.clear()
        for session in sessions:
            session.close()
        self._sender.join(timeout=5)


def _error_body(worker: str, error: Exception) -> dict:
    """The reply to a refused request: nothing it asked for happened, not even its frees."""
    code = getattr(error, "code", "refused")
    return {
        "ok": False,
        "error": {"worker": worker, "message": str(error), "code": code, "refused": True},
    }


def _client_key(sender: str, msg: dict) -> str:
    """Who owns the tensors a request names: the sender's identity and its session."""
    session = msg.get("session")
    return f"{sender}/{session}" if isinstance(session, str) else sender
