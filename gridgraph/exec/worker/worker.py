"""The worker runtime: receives requests, runs each client's programs, replies.

Threat model: a worker on an open grid serves peers it has never met, who may send anything:
every message is hostile until checked, and nothing one client sends may read or change
another client's data, crash the worker, or stall other clients. State: `sessions`, client
key (sender identity/session id) -> Session (session.py); `ended` and `left`, why sessions
ended (by the worker; by their client's bye); token buckets per peer for requests and for
refusals; the serving threads; one outbox and its sender thread (outbox.py). A peer, for
every per-peer limit, is the transport's `owner` of the sender (on IPFS the Kubo node).

Policy:
- the transport's thread only opens (safety/intake.py: size, its peer's rate of header
  bytes, then decoding with caps), checks and enqueues (`on_message`); each session's
  requests run in arrival order on a thread of its own (`_drain`), its runs in the order its
  client sent them (session.py `held`), in its executor process when the worker was given
  an `Isolation`: no client's long program delays another's; a cancelled run stops between
  ops;
- exactly once: a request id runs at most once per session, and every accepted request gets
  exactly one reply; a refused one changes nothing (`_accept_request` has the rules); drops
  are logged a bounded number of times (safety/droplog.py);
- bounded: messages by `max_message_bytes`; a peer by `sessions_per_peer` (`_session`), its
  request rate and its refusals' rate, its share of the network process's memory (`budget`,
  safety/budget.py: what waits in queues and in the outbox, records, transfers) and of the
  executor places (shares.py); a session by its memory (queued requests included) and time
  limits; an ended session's requests are refused as `session-ended`;
- replies go only to the sender's own topic for its session; transfers only between the
  identities a run names for its workers (`peers`, run.py refuses a run without them), kept
  against someone's memory (`_accept_transfer`), resent only to the identity they went to
  (`_resend`). The worker's own view of the grid (its directory) never says who one is.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from gridgraph.exec import wire
from gridgraph.exec.protocol import (
    ALREADY_SERVED,
    MAX_REQUEST_ID,
    MAX_SESSION_ID,
    REQUEST_KINDS,
    SESSION_ENDED,
    client_topic,
    worker_topic,
)
from gridgraph.exec.safety.budget import QUEUED_BYTES, MemoryBudget
from gridgraph.exec.safety.droplog import DropLog
from gridgraph.exec.safety.intake import Intake
from gridgraph.exec.safety.limits import (
    RECORD_BYTES,
    TRANSFER_BYTES,
    LimitExceeded,
    Limits,
    RateLimiter,
    format_size,
)
from gridgraph.exec.transport import Transport
from gridgraph.exec.worker.outbox import Outbox
from gridgraph.exec.worker.run import (
    RESEND_AFTER,
    Isolation,
    UpstreamFailed,
    answer,
    checked_transfer_key,
    encode_reply,
    error_body,
    one_tensor_per_value,
    resend_wait,
    transfer_key,
)
from gridgraph.exec.worker.session import (
    ACKNOWLEDGED,
    EndedSessions,
    ExecutorLost,
    RequestError,
    Session,
)
from gridgraph.exec.worker.shares import make_place

log = logging.getLogger("gridgraph.worker")

# A session's serving thread waits this long for its next request before it ends.
SERVER_LINGER = 2.0
# How long `close` waits, at most, for its threads to end (a long op may be running).
CLOSE_WAIT = 5.0
# The reply to a request of a session that ended before it ran (nothing of it ran).
ENDED_BEFORE_RUN = RequestError(
    "the session ended (its bye, its lease, or its peer opening too many) before this request "
    "ran; nothing of it ran",
    SESSION_ENDED,
)
# A kept reply or transfer is sent again this often when asked (ipfs: PubSub loses 0.5-3% of
# messages under load, so a few resends cover honest losses). Then a transfer is not sent
# again, and a reply only once REPLY_RESEND_GAP s passed since its latest copy went, twice as
# long after each copy: under load a reply is slow more often than lost, and a request that
# ran is never answered with an error for being asked again.
RESENDS = 4
REPLY_RESEND_GAP = 0.5


class Worker:
    """A gridgraph worker on one transport endpoint."""

    def __init__(
        self,
        name: str,
        transport: Transport,
        *,
        limits: Limits | None = None,
        isolation: Isolation | None = None,
        recv_timeout: float = 120.0,
        peer_alive: Callable[[str], bool] = lambda name: True,
        budget: MemoryBudget | None = None,
    ) -> None:
        self.name = name
        self.transport = transport
        self.limits = limits or Limits()
        # Run each session's programs in an executor process of its own (isolation/executor.py).
        self.isolation = isolation
        self._executor_places = threading.BoundedSemaphore(self.limits.max_executors)
        if isolation is not None:
            isolation.prewarm()
        self.recv_timeout = recv_timeout
        # Whether another worker still answers (heartbeats on IPFS): a recv from a dead one
        # fails at once instead of after recv_timeout, even if its client's abort was lost.
        self.peer_alive = peer_alive
        self.sessions: dict[str, Session] = {}
        self.busy_seconds = 0.0  # spent serving requests, all sessions together
        self.ended = EndedSessions()  # (under _lock)
        self.left = EndedSessions()  # sessions ended by their bye (under _lock)
        self._left_why = f"this session ended at its client's bye to worker {name}"
        # What each peer makes this process hold (queued requests, records, replies kept,
        # transfers; the transport's block payloads if it shares this), in max_worker_memory.
        # A transfer no run of its session named is charged to its sender, not the session.
        self.budget = budget or MemoryBudget.of(self.limits)
        self._lock = threading.Lock()  # guards sessions
        self._places = threading.Lock()  # one session at a time takes an executor place
        self._rate = RateLimiter(self.limits.requests_per_second, self.limits.request_burst)
        # Refusals a peer over its rate is sent, at the same rate: past both, its requests
        # are dropped unanswered (each refusal is a message from the one sender thread).
        self._refusals = RateLimiter(self.limits.requests_per_second, self.limits.request_burst)
        self._drops = DropLog(log)
        self._intake = Intake(name, self.limits, self._drops)  # (size, header rate, decode)
        # Publications decided on the transport's thread go out from one thread of its own.
        self._outbox = Outbox(name, transport, self.budget, self._drops)
        self._closed = False
        self._serving: set[threading.Thread] = set()  # session threads started (under _lock)
        transport.subscribe(worker_topic(name), self.on_message)

    # --- receiving (the transport's thread: check, enqueue, never block) -------------------

    def on_message(self, sender: str, payload: bytes) -> None:
        msg = self._intake.open(self.transport.owner(sender), sender, payload)
        if msg is None:
            return
        try:
            kind = msg["kind"]
            if kind == "transfer":
                self._accept_transfer(sender, msg, payload)
            elif kind == "resend":  # ipfs: a receiver missed a transfer
                self._resend(sender, msg)
            elif kind == "abort":  # the session's thread may be blocked in a recv
                session = self._session(_client_key(sender, msg), sender, create=False)
                if session is not None:
                    session.abort(msg.get("run"), msg.get("upto"))
            else:
                self._accept_request(sender, msg, payload)
        except Exception:  # a bug must not take the transport's thread down
            log.exception("%s: failed to accept a message from %s", self.name, sender)

    def _accept_request(self, sender: str, msg: dict, payload: bytes) -> None:
        """Check a request on the transport's thread; queue it for its session, or answer it.

        Exactly once: a request id runs at most once per session. A resend of a request
        queued or running is ignored; one already answered gets its reply again (RESENDS
        times at most) while its client has not acknowledged it (session.py keeps it until
        then); one under the session's acknowledged watermark with no record is an old copy,
        refused as already served. Each request's `ack` applies whatever becomes of it (it
        lets go only of what its own client kept). Answers again go within the peer's
        request rate (past it, the resend is ignored: a refusal would say that a request
        which ran did not). Every accepted request gets exactly one reply: an error reply if
        anything fails, including encoding the reply itself, or if its session ends (bye,
        lease, eviction) before it runs.

        A refused request changes nothing, not even its `free` list: frees apply only once
        the request was accepted and served. A request over the peer's rate, the session's
        memory or time limit is refused with an error naming the limit (limits.py); so is
        one that would make the requests waiting in the session's queue hold more than its
        memory limit (they are held here, whatever runs them). Refusals for a peer over its
        rate are themselves limited to that rate: past it, its requests are dropped
        unanswered and unrecorded (a resend later is judged afresh), so a flood of tiny
        requests cannot fill the one sender thread's queue ahead of other clients' replies.
        A malformed request gets an error reply when it has an id and a session id, and its
        id is at most MAX_REQUEST_ID characters (a reply names its request: a longer id is
        dropped rather than echoed, and kept nowhere). A reply goes to the sender's own
        topic for that session (`client_topic`), which no request names."""
        rid, session_id = msg.get("id"), msg.get("session")
        if not isinstance(rid, str) or not isinstance(session_id, str):
            self._drops.warning(self.transport.owner(sender), "%s: dropped a %.40r request "
                                "without id or session", self.name, msg["kind"])  # fmt: skip
            return
        if len(rid) > MAX_REQUEST_ID:  # (a reply names its request: it would echo the id)
            self._drops.warning(self.transport.owner(sender), "%s: dropped a %.40r request "
                                "whose id has %d characters, over %d", self.name, msg["kind"],
                                len(rid), MAX_REQUEST_ID)  # fmt: skip
            return
        # Replies go only to the sender's own topic: no request names where they go.
        reply_to = client_topic(sender, session_id)
        arrived = time.monotonic()
        key, owner = _client_key(sender, msg), self.transport.owner(sender)
        if len(session_id) > MAX_SESSION_ID:
            if self._refusals.allow(owner):
                error = f"a session id has at most {MAX_SESSION_ID} characters"
                self._refuse(owner, reply_to, rid, RequestError(error))
            return
        try:
            session = self._session(key, owner, create=msg["kind"] != "bye")
        except (RequestError, LimitExceeded) as e:
            if self._refusals.allow(owner):
                self._refuse(owner, reply_to, rid, e)
            return
        if session is None:  # a bye for a session that is gone: nothing left to free
            if self._rate.allow(owner):  # answered within the peer's rate, as any request
                bye = encode_reply(self.name, rid, {"ok": True, "freed": 0})
                self._outbox.put(owner, reply_to, bye)
            elif self._refusals.allow(owner):
                self._refuse(owner, reply_to, rid, self._over_rate())
            return
        with session.cv:
            if session.closed:  # ended by its bye, its lease or an eviction meanwhile
                self._refuse(owner, reply_to, rid, ENDED_BEFORE_RUN)
                return
            session.last_seen = arrived  # seen now, not when served: a queued request keeps
            rec = session.records.get(rid)  # the lease
            stale = rec is None and session.stale(rid)  # (before this request's own ack)
            session.acknowledge(msg.get("ack"))
            session.reply_topic = reply_to
            if rec is not None or stale:  # a resend, or an old copy: never run twice
                lost = rec is not None and rec.reply is not None and arrived > rec.sent_at
                if lost and rec.resent >= RESENDS:  # past RESENDS copies: paced, not refused
                    gap = REPLY_RESEND_GAP * 2 ** min(rec.resent - RESENDS, 16)
                    if arrived - rec.sent_at < gap:
                        return  # its latest copy may be on its way (slow, not lost): the
                        # client asks again later. (A reply can be large, each copy a publish.)
                why = ACKNOWLEDGED if stale else rec.dropped
                forgotten = not lost and (stale or rec.sent_at < arrived)
                if (lost or forgotten) and not self._rate.allow(owner):
                    # Answered again only within the peer's rate (a reply can be large, and
                    # the sender thread is everyone's); unanswered, the client asks again.
                    return
                if lost and self._outbox.put(owner, reply_to, rec.reply, kept=True):
                    rec.resent, rec.sent_at = rec.resent + 1, arrived
                elif forgotten:
                    error = RequestError(
                        f"request already served; its reply is no longer kept here: {why}",
                        ALREADY_SERVED,
                    )
                    self._refuse(owner, reply_to, rid, error)
                return
            cap = self.limits.max_client_memory  # (what waits is held here, executor or not)
            if not self._rate.allow(owner):
                if not self._refusals.allow(owner):
                    log.debug("%s: dropped a request of %s, over twice its rate", self.name, key)
                    return  # not recorded: a resend later is judged afresh
                error = self._over_rate()
            elif msg["kind"] not in REQUEST_KINDS:
                error = RequestError(f"unknown request kind {msg['kind']!r:.60}")
            elif cap is not None and session.queued_bytes + len(payload) > cap:
                waiting = format_size(session.queued_bytes + len(payload))
                error = LimitExceeded(
                    f"the requests waiting here need {waiting} on this worker, over the "
                    f"client's memory limit of {format_size(cap)} (max_client_memory)"
                )
            else:
                error = None
            held = RECORD_BYTES + (len(payload) + QUEUED_BYTES if error is None else 0)
            if not self.budget.charge(owner, held):  # kept here: the peer's memory budget
                if self._refusals.allow(owner):  # (unrecorded: a resend is judged afresh)
                    refusal = self.budget.refusal(owner, held, "this request")
                    self._refuse(owner, reply_to, rid, refusal)
                return
            session.record(rid)  # a refusal is an answer too: recorded like one
            if error is not None:
                self._drops.warning(owner, "%s: refused a %.40r request from %s: %s", self.name,
                                    msg["kind"], key, error)  # fmt: skip
                self._reply(session, rid, self._error_reply(rid, error), queued=True)
                return
            # One that arrives while another waits or runs is kept as received, decoded when
            # served: decoded, a header of many small containers holds some 70 times its
            # bytes, and its session is charged the bytes received. One that finds the
            # session idle (a client's next step, sent once its last reply came) stays
            # decoded: decoded once, and served at once.
            entry = (None if session.busy else msg, arrived, payload)
            session.queued_bytes += len(payload)
            if msg["kind"] == "run" and not session.in_turn(msg.get("after")):
                session.hold(msg["after"], rid, (None, arrived, payload))
                return  # queued once the run sent before it is (protocol.py: `after`)
            session.queue.extend([entry, *session.in_turn_now(rid)])
            session.busy = True
            if session.serving:  # its thread is running or waiting for more
                session.cv.notify_all()
                return
            session.serving = True
        thread = threading.Thread(
            target=self._drain, args=(session,), name=f"{self.name}-{key[-12:]}", daemon=True
        )
        with self._lock:  # (the ones that ended are dropped here)
            self._serving = {t for t in self._serving if t.is_alive()} | {thread}
        try:
            thread.start()
        except RuntimeError as e:  # no thread to be had (the process is at its limit)
            with self._lock:
                self._serving.discard(thread)
            error = f"worker {self.name} could not start a thread to serve this session: {e}"
            self._fail_queued(session, RequestError(error))

    def _fail_queued(self, session: Session, error: Exception) -> None:
        """Answer every request waiting in `session`'s queue with `error`, none of them run,
        and leave the session ready for its next request."""
        with session.cv:
            waiting = [*session.queue, *session.take_held()]
            session.queue.clear()
            session.queued_bytes = 0
            session.busy = session.serving = False
        queued = sum(len(payload) + QUEUED_BYTES for _, _, payload in waiting)
        self.budget.release(session.peer, queued)
        for msg, _, payload in waiting:
            msg = msg if msg is not None else wire.decode(payload)  # (checked when it came)
            reply = self._error_reply(msg["id"], error)
            self._reply(session, msg["id"], reply, queued=True)

    def _over_rate(self) -> LimitExceeded:
        return LimitExceeded(
            f"over the rate limit of {self.limits.requests_per_second:g} requests a second "
            f"per peer (requests_per_second)"
        )

    def _session(
        self, key: str, peer: str, create: bool, opened_by: str | None = None
    ) -> Session | None:
        """Session `key` of `peer`; if there is none and `create`, a new one, within the
        peer's `sessions_per_peer` (`_make_room`). A request passes `opened_by=None`. A
        transfer may arrive before its client's first request and open the session it
        names: it passes its sender's identity, and such a session counts against that
        identity (`sessions_per_peer` of them, and no eviction), not against the peer it
        names, until that peer's own request adopts it. So no one else's transfers can make
        a worker end a client's sessions. A session in `ended` or `left` is refused as
        `session-ended` naming the cause (the client raises `gg.SessionLost`), and no empty
        session opens in its place: its runs would fail as "value not stored", and it would
        hold what the request brought (a put delayed past its bye) until its lease ran out."""
        with self._lock:
            session = self.sessions.get(key)
            if session is None and not create:
                return None
            if session is not None and (not create or opened_by or not session.opened_by):
                return session
            if session is None:
                why = self.ended.why(peer, key) or self.left.why(peer, key)
                if why is not None:
                    raise RequestError(why, SESSION_ENDED)
            # A new session, or its client's first request to one a transfer opened.
            self._make_room(peer, opened_by)
            if session is None:
                session = self.sessions[key] = Session(key, peer)
                session.release_stray = self._release_stray
                session.charge = lambda nbytes: self.budget.charge(peer, nbytes)
                session.release = lambda nbytes: self.budget.release(peer, nbytes)
                session.fits = lambda nbytes: self.budget.fits(peer, nbytes)
            session.opened_by = opened_by
            return session

    def _release_stray(self, sender: str, nbytes: int) -> None:
        self.budget.release(self.transport.owner(sender), nbytes)

    def _make_room(self, peer: str, opened_by: str | None) -> None:
        """Make room for one more session of `peer` (the caller holds `_lock`): under the
        `sessions_per_peer` limit, by closing the peer's own oldest idle session if need be.
        Transfers from `opened_by` open at most that many and close none."""
        limit = self.limits.sessions_per_peer
        if opened_by:
            if sum(s.opened_by == opened_by for s in self.sessions.values()) >= limit:
                raise LimitExceeded(
                    f"transfers from {opened_by} already opened {limit} sessions here "
                    f"(sessions_per_peer)"
                )
            return
        theirs = [s for s in self.sessions.values() if s.peer == peer and not s.opened_by]
        if len(theirs) < limit:
            return
        by_age = sorted(theirs, key=lambda s: s.last_seen)
        oldest = next((s for s in by_age if s.end_if_idle()), None)  # the peer's own, idle
        if oldest is None:
            raise LimitExceeded(
                f"this peer already runs {len(theirs)} sessions here (sessions_per_peer)"
            )
        del self.sessions[oldest.key]
        log.info("%s: client %s evicted: its peer opened a session over its %d",
                 self.name, oldest.key, limit)  # fmt: skip
        self.ended.add(
            oldest,
            f"worker {self.name} ended this session, and freed its tensors, to make room for "
            f"a newer one of the same peer, over its {limit} (sessions_per_peer)",
        )
        oldest.close()

    def _accept_transfer(self, sender: str, msg: dict, payload: bytes) -> None:
        """Keep a transfer in the inbox of the session it names (opening it, `_session`),
        with its sender's identity: a run takes it only from the identity its client named
        for the sending worker (run.py), so a peer that owns or claims a worker's name
        in this worker's directory can place nothing a run uses. It counts against that
        session's memory if one of its runs named the sender, and in the worker's memory
        `budget` against the session's peer; else only there, against the sender. One over
        a limit is kept as a small error in its place, so that a run waiting for it fails
        naming the limit, and dropped when not even that fits."""
        values = msg.get("values")
        first = values[0] if isinstance(values, list) and values else None
        key = checked_transfer_key(msg.get("run"), first, msg.get("src"), msg.get("client"))
        if key is None:
            self._drops.warning(self.transport.owner(sender), "%s: dropped a malformed transfer "
                                "from %s", self.name, sender)  # fmt: skip
            return
        client = msg["client"]
        session = self._session(client, client.split("/", 1)[0], create=False)
        if session is None:
            session = self._transfer_session(client, sender)
            if session is None:
                return
        if msg.get("error") is None and not one_tensor_per_value(values, msg.get("tensors")):
            msg = {"error": "a transfer must carry one tensor per value id, each id once, or "
                   "an error"}  # fmt: skip
            payload = b""
        # Charged to the session if one of its runs named the sender, else to the sender.
        stray, owner = sender not in session.named, self.transport.owner(sender)
        cap = self.limits.max_client_memory

        charged = owner if stray else session.peer

        def fits(p: bytes) -> bool:  # (a sender's strays: within one client's memory too)
            if not stray and not session.inbox_fits(p, cap):
                return False
            return self.budget.charge(charged, len(p) + TRANSFER_BYTES, cap if stray else None)

        if not fits(payload):
            over = f"over the client's memory limit of {cap} bytes (max_client_memory)"
            if not self.budget.fits(charged, len(payload) + TRANSFER_BYTES):
                over = str(self.budget.refusal(charged, len(payload), "this transfer"))
            msg, payload = {"error": over}, b""
        if not payload:  # an error in place of the transfer: what an executor is sent
            msg = {"kind": "transfer", **msg}
            payload = wire.encode(msg)
            if not fits(payload):
                # Not even the error fits: kept, errors under keys no run takes would grow
                # the inbox past the limit without bound. A run waiting for it times out.
                self._drops.warning(owner, "%s: dropped a transfer for %s: its memory limit "
                                    "is reached", self.name, client)  # fmt: skip
                return
        # Kept with its sender, whoever that is: a run takes it only from the identity its
        # client named for the sending worker.
        if not session.deliver(key, sender, payload, stray):
            self.budget.release(charged, len(payload) + TRANSFER_BYTES)

    def _transfer_session(self, client: str, sender: str) -> Session | None:
        """The session a transfer from `sender` names, opened if `sender` may open one more."""
        peer, opened_by = (self.transport.owner(i) for i in (client.split("/", 1)[0], sender))
        try:
            return self._session(client, peer, create=True, opened_by=opened_by)
        except (RequestError, LimitExceeded) as e:
            self._drops.warning(opened_by, "%s: dropped a transfer for %s: %s", self.name,
                                client, e)  # fmt: skip
            return None

    def _resend(self, sender: str, msg: dict) -> None:  # ipfs:
        """Send a kept transfer again, if the identity it was sent to asks for it."""
        key = checked_transfer_key(
            msg.get("run"), msg.get("value"), msg.get("dst"), msg.get("client")
        )
        if key is None:
            return
        session = self._session(msg["client"], "", create=False)
        kept = session.sent.get(key) if session is not None else None
        # Within the asker's request rate, and RESENDS times at most: a kept transfer can be
        # large, the sender thread is everyone's, and a client may name itself as the
        # identity it went to (2,000 asks for one 64 MiB transfer would publish 128 GB).
        if kept is not None and kept[0] == sender and kept[2] < RESENDS:
            owner = self.transport.owner(sender)
            if self._rate.allow(owner) and self._outbox.put(
                owner, worker_topic(key[2]), kept[1], kept[0], kept=True
            ):
                kept[2] += 1

    # --- serving (one thread per busy session) ---------------------------------------------

    def _drain(self, session: Session) -> None:
        """Serve `session`'s queue, one request at a time in arrival order, so that one
        client's long program, or a `recv` that waits, delays no other client; wait
        SERVER_LINGER s for more before the thread ends.

        One lasting thread per active session, rather than one per burst of requests:
        torch's intra-op thread pool (OpenMP) belongs to the thread that calls into it, and
        a new thread per step would start a new pool, cold, every step.
        """
        while True:
            with session.cv:
                if not session.queue:
                    session.busy = False
                    session.cv.wait_for(lambda: session.queue or session.closed, SERVER_LINGER)
                if not session.queue or session.closed:
                    session.busy = session.serving = False
                    return
                msg, arrived, payload = session.queue.popleft()
                session.queued_bytes -= len(payload)
                self.budget.release(session.peer, len(payload) + QUEUED_BYTES)
            started = time.monotonic()
            try:
                if msg is None:
                    msg = wire.decode(payload)  # (checked when it arrived)
                self._serve(session, msg, payload)
            except Exception as e:  # a bug must not take the worker down
                log.exception("%s: failed to serve a request of %s", self.name, session.key)
                self._answer_failure(session, msg, e)
            finally:  # (a recv waiting on another worker counts: the session holds it)
                if msg is not None and msg.get("kind") not in ("stats", "ping"):
                    served = time.monotonic() - started
                    session.busy_seconds += served
                    self.busy_seconds += served

    def _answer_failure(self, session: Session, msg: dict | None, error: Exception) -> None:
        """Reply with an error to a request whose serving failed unexpectedly, unless it was
        answered already: every accepted request gets exactly one reply."""
        try:
            rid = msg["id"]
            record = session.records.get(rid)
            if record is None or record.reply is not None:
                return
            failure = RequestError(
                f"worker {self.name} failed to serve this request ({type(error).__name__}: "
                f"{error}); see its log"
            )
            self._reply(session, rid, self._error_reply(rid, failure))
        except Exception:
            log.exception("%s: could not answer a request that failed", self.name)

    def _serve(self, session: Session, msg: dict, payload: bytes) -> None:
        rid, kind = msg["id"], msg["kind"]
        if kind == "bye":
            freed = 0
            if session.executor is not None and session.executor.lost is None:
                try:  # the executor holds the tensors: it counts them
                    done = wire.decode(session.executor.request(payload, 0, self, session))
                    freed = int(done.get("freed", 0))
                except (ExecutorLost, wire.WireError, ValueError, TypeError):
                    pass
            freed += self._forget(session)
            log.info("%s: client %s freed %d tensors", self.name, session.key, freed)
            reply = encode_reply(self.name, rid, {"ok": True, "freed": freed})
            self._publish(session, session.reply_topic, reply, counted=True)
            return
        if kind == "run" and session.is_aborted(msg.get("run")):  # (cancelled while queued)
            error = RequestError(f"run {msg['run']} was cancelled by its client; nothing of it ran")
            self._reply(session, rid, self._error_reply(rid, error))
            return
        session.seeded |= kind == "seed"  # (its executor then holds its random stream)
        peers = msg.get("peers")
        if kind == "run" and isinstance(peers, dict):  # what they send it is its own data
            session.name_workers(peers.values())
        if self.isolation is None or session.executor is None and kind in ("ping", "free", "stats"):
            # (before its executor starts, a session holds nothing: these need none)
            reply = answer(self, session, msg, len(payload))
        else:
            try:
                if session.executor is None:  # a place within its peer's fair share (shares.py)
                    with self._places:  # (a place being started counts as held)
                        with self._lock:
                            sessions = list(self.sessions.values())
                        make_place(session, sessions, self.limits.max_executors)
                        session.starting = True
                    try:
                        session.executor = self.isolation.start(
                            self.name,
                            session.key,
                            self.limits,
                            self.recv_timeout,
                            self._executor_places,
                        )
                    finally:
                        session.starting = False
                held = session.memory() - session.elsewhere
                reply = session.executor.request(payload, held, self, session)
            except LimitExceeded as e:  # no executor to be had: the worker runs its maximum
                reply = encode_reply(self.name, rid, error_body(self.name, e))
            except OSError as e:  # none could be started (no descriptors, no memory, ...)
                error = RequestError(
                    f"worker {self.name} could not start a process for this session ({e}); "
                    f"nothing ran, try again"
                )
                reply = encode_reply(self.name, rid, error_body(self.name, error))
            except ExecutorLost as e:
                lost = ExecutorLost(
                    f"this client's session on worker {self.name} was lost: its executor "
                    f"process ended because {e}; the tensors it held here are gone"
                )
                reply = encode_reply(self.name, rid, error_body(self.name, lost))
        if kind == "stats":  # the traffic is counted here, whatever runs the programs
            reply = self._with_traffic(session, rid, reply, bool(msg.get("reset")))
        self._reply(session, rid, reply, counted=kind != "stats")

    def _reply(
        self, session: Session, rid: str, reply: bytes, queued: bool = False, counted: bool = True
    ) -> None:
        """Send `reply` to request `rid`, and keep it on the request's record to send again
        if the client asks. `queued`: through the shared sender thread, for a caller that
        must not block (the transport's reader); else published here, counted in the
        session's traffic if `counted`. A resend that comes before `sent_at` is set waits."""
        with session.cv:
            rec = session.records.get(rid)
            if rec is not None:
                session.replied(rec, reply)
        if queued:  # (a refusal, kept on its record: a resend gets it, if shed here)
            self._outbox.put(session.peer, session.reply_topic, reply, refusal=True)
        else:
            self._publish(session, session.reply_topic, reply, counted)
        if rec is not None:
            rec.sent_at = time.monotonic()

    def _with_traffic(self, session: Session, rid: str, reply: bytes, reset: bool) -> bytes:
        body = wire.decode(reply)
        if body.get("ok"):
            body.update(messages=session.traffic.messages, bytes=session.traffic.bytes,
                        busy_seconds=session.busy_seconds)  # fmt: skip
            if reset:
                session.traffic.reset()
                session.busy_seconds = 0.0
        return wire.encode(body)

    def _error_reply(self, rid: str, error: Exception) -> bytes:
        return encode_reply(self.name, rid, error_body(self.name, error))

    def _refuse(self, peer: str, reply_to: str, rid: str, error: Exception) -> None:
        """An error reply decided on the transport's thread (nothing recorded, nothing run),
        sent within `peer`'s share of what waits in the outbox (else shed: a resend of the
        request is judged afresh)."""
        self._drops.warning(peer, "%s: refused a request of %s: %s", self.name, peer, error)
        self._outbox.put(peer, reply_to, self._error_reply(rid, error), refusal=True)

    def _publish(
        self, session: Session, topic: str, payload: bytes, counted: bool, to: str | None = None
    ) -> None:
        if counted:
            session.traffic.add(len(payload))
        try:
            self.transport.publish(topic, payload, counted, to)
        except Exception as e:  # the transport is closing, or the node is down
            log.warning("%s: could not send to %s: %s", self.name, topic, e)

    # --- sessions ending ------------------------------------------------------------------

    def _forget(self, session: Session) -> int:
        """End `session` at its bye: free it, refuse the requests queued behind the bye, and
        remember it ended (`left`), so that one coming later is refused too."""
        with session.cv:
            session.closed = True  # later requests are refused on arrival
            waiting = [*session.queue, *session.take_held()]
        with self._lock:
            if self.sessions.get(session.key) is session:
                del self.sessions[session.key]
            self.left.add(session, self._left_why)
        n = session.close()
        for msg, _, payload in waiting:
            msg = msg or wire.decode(payload)  # (checked when it arrived)
            self._refuse(session.peer, session.reply_topic, msg["id"], ENDED_BEFORE_RUN)
        log.info("%s: client %s left", self.name, session.key)
        return n

    def expire_clients(self, lease: float) -> None:
        """Free everything of clients silent for longer than `lease` seconds."""
        now = time.monotonic()
        with self._lock:
            silent = [s for s in self.sessions.values() if now - s.last_seen > lease]
        for session in silent:
            if session.end_if_idle():
                log.info("%s: lease of client %s expired", self.name, session.key)
                with self._lock:
                    if self.sessions.get(session.key) is session:
                        del self.sessions[session.key]
                    self.ended.add(
                        session,
                        f"the lease of this session on worker {self.name} expired: it was "
                        f"silent for over {lease:g} s, and the worker freed its tensors",
                    )
                session.close()

    # --- transfers between workers (called by Run) -----------------------------------------

    def transfer(self, session: Session, dst: str, peer: str, msg: dict) -> None:
        """Send a transfer message to worker `dst`, identity `peer` (see run.Host)."""
        self.publish_transfer(session, dst, peer, transfer_key(msg), wire.encode(msg))

    def publish_transfer(
        self, session: Session, dst: str, peer: str, run_value: tuple[int, int], payload: bytes
    ) -> None:
        """Send a transfer to worker `dst`, only to identity `peer` (the one its run names; on
        IPFS sealed for it), and keep it a while, in case that identity asks again. # ipfs:
        Kept within the client's memory limit, as far as the rest of what the session holds
        leaves room, and within its peer's share of the memory budget."""
        session.keep_sent((*run_value, dst), peer, payload, self.limits.max_client_memory)
        self._publish(session, worker_topic(dst), payload, counted=True, to=peer)

    def receive(
        self,
        session: Session,
        key: tuple[int, int, str],
        peer: str,
        deadline: float,
        ask_after: float,
    ) -> dict:
        """The transfer `key` = (run, value id, sending worker) that identity `peer` sent
        for `session` (see Host)."""
        return wire.decode(self.wait_transfer(session, key, peer, deadline, ask_after))

    def heed_cancel(self, session: Session) -> None:
        """(A cancel is in `session` already: `on_message` applied it; see Host.)"""

    def wait_transfer(
        self,
        session: Session,
        key: tuple[int, int, str],
        peer: str,
        deadline: float,
        ask_after: float,
    ) -> bytes:
        """The transfer `key` from the worker it names, sent by identity `peer`, as received;
        give up once that worker or the client is gone (or at `deadline`), asking `peer` for
        a resend (ipfs) after `ask_after` s (as `run.resend_wait` bounds it), then after
        twice RESEND_AFTER s, twice as long each time."""
        run, vid, src = key
        wait = RESEND_AFTER  # (after the first ask, which may come sooner: exec/resend.py)
        ask = time.monotonic() + resend_wait(ask_after)
        with session.cv:
            while not session.has_transfer(key, peer):
                if session.is_aborted(run):
                    raise UpstreamFailed(f"run {run} was aborted by its client")
                if session.closed:
                    raise UpstreamFailed("the session was closed")
                if not self.peer_alive(src):
                    raise UpstreamFailed(f"worker {src} stopped answering")
                now = time.monotonic()
                if now >= deadline:
                    raise TimeoutError(f"timed out waiting for %{vid} from worker {src}")
                if now >= ask:  # ipfs: maybe dropped; the sender resends it if it was sent
                    self.ask_resend(session, run, vid, src, peer)
                    wait = min(2 * wait, 8 * RESEND_AFTER)  # ipfs: slow, or lost again
                    ask = now + wait
                session.cv.wait(min(deadline, ask) - now)
            return session.take(key, peer)

    def ask_resend(self, session: Session, run: int, vid: int, src: str, peer: str) -> None:
        """ipfs: ask worker `src`, identity `peer`, to send a transfer again (it may have
        been dropped)."""
        resend = {"kind": "resend", "client": session.key, "run": run, "value": vid,
                  "dst": self.name}  # fmt: skip
        self._outbox.put(session.peer, worker_topic(src), wire.encode(resend), peer)

    @property
    def closed(self) -> bool:
        """Whether `close` stopped it (a local grid's client then takes it for lost)."""
        return self._closed

    def close(self) -> None:
        self._closed = True
        self.transport.close()
        self._outbox.close()
        with self._lock:
            sessions = list(self.sessions.values())
            self.sessions.clear()
        for session in sessions:
            session.close()
        # Wait for the serving threads to end: one still unwinding torch's thread-local
        # state (its OpenMP team) while the interpreter exits can abort the process.
        deadline = time.monotonic() + CLOSE_WAIT
        with self._lock:
            serving = list(self._serving)
        for thread in [self._outbox.thread, *serving]:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))


def _client_key(sender: str, msg: dict) -> str:
    """Who owns the tensors a request names: the sender's identity and its session."""
    session = msg.get("session")
    return f"{sender}/{session}" if isinstance(session, str) else sender
