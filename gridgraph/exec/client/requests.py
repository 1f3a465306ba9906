"""Reliable requests: a client's requests to its workers, their resends, and their replies.

State (under `_cv`: a reply on the transport's thread may change it):
    frees          per worker, value ids to free, sent with the next request to that worker;
                   those of a request refused, or that ends without its reply, go back here
    free batches   the batches of frees sent on their own (once FREE_BATCH ids wait for one
                   worker), unawaited, until their reply: the ids of one lost or refused go
                   back into `frees`, sent with the next request to that worker
    outstanding    request id -> (the identity it is sealed for and only it may answer,
                   payload to resend, the ids it frees), until its wait ends
    replies        request id -> its reply, until its waiter takes it
    waiting        the request ids each waiting call needs
    unacked        per worker, the numbers of the requests sent it whose replies the client
                   still needs (in the order sent, so the first is the least)
    acked above    per worker, numbers above the first unacked one whose replies it no
                   longer needs (received, or given up)

Acknowledgements: each request tells its worker which replies the client no longer needs
(`ack`, protocol.py): every id under the least unacked one sent to that worker, and up to
MAX_ACK_IDS of those above. The worker keeps every other reply, so a resent request is
answered from it however many are in flight, and answered "already served" only once its
reply was acknowledged. A request counts as no longer needed once its wait ended (its reply
taken, or given up on: timed out, its worker lost, interrupted), a batch of frees once its
reply came or its ids went back into `frees`.

Policy: a request without its reply is sent again after `retry_after` s, then twice as long
each time (at most 8 times as long), or first sooner where answers to the same kind of
request came sooner (exec/resend.py); workers answer a repeated request id from their reply
cache. A request larger than its worker reads (`message_limit`) is refused before it is
sent. A reply counts only from the identity its request was sealed for (a message from any
other is dropped before it is decoded); a waiter wakes once all of its replies are in. A
worker that `alive` says is gone fails its waits at once, unless it replied within
HEARD_ALIVE s (a reply is a sign of life too).

The seam: the client hands this its requests (`send`, `wait`, `wait_all`, `call`), the ids
to free (`free`, `free_later`) and the workers that join (`add_worker`); this knows workers
by name and value ids as plain numbers, nothing of plans or pointers, and tells the client
only that a worker is lost (`on_lost`, which describes what went with it).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import threading
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass

from gridgraph.errors import GridError, RemoteError, SessionLost, WorkerLost
from gridgraph.exec import resend, wire
from gridgraph.exec.protocol import MAX_ACK_IDS, SESSION_GONE, worker_topic
from gridgraph.exec.transport import NotSent, Transport

# A standalone free message goes out once this many releases wait for one worker.
FREE_BATCH = 512
# A worker that replied within this many seconds is alive, whatever `alive` says (on IPFS,
# heartbeats: as long as ipfs/discovery.py's DEAD_AFTER).
HEARD_ALIVE = 5.0
MiB = 1 << 20
LOST_HINT = (
    "the grid goes on without it: send what you need again to the workers left "
    "(grid.workers), or connect again once it is back"
)


@dataclass(slots=True)
class _FreeBatch:
    """A batch of frees sent unawaited, until its reply."""

    worker: str
    identity: str | None  # the only endpoint that may answer it
    ids: list[int]
    sent_at: float  # time.monotonic()
    refused: bool = False


class Requests:
    """The requests of one client session to its workers, and their replies.

    >>> requests = Requests(transport, topic, session, ["w0"], on_lost=lambda w: [])
    >>> requests.call("w0", {"kind": "ping"})["ok"]
    True
    """

    def __init__(
        self,
        transport: Transport,
        topic: str,
        session: str,
        workers: list[str],
        *,
        timeout: float = 300.0,
        retry_after: float = 2.0,
        alive: Callable[[str], bool] = lambda worker: True,
        message_limit: Callable[[str], int | None] = lambda worker: None,
        on_lost: Callable[[str], list[str]],
    ) -> None:
        self.transport = transport
        self.session = session
        self.timeout = timeout
        # Best-effort transports may drop a request or its reply: resend after this long, or
        # once sooner (`_answer_times`); workers answer a repeated request id from their
        # reply cache, never run it twice.
        if not (type(retry_after) in (int, float) and 0 < retry_after < math.inf):
            raise ValueError(f"retry_after is a positive number of seconds, got {retry_after!r}")
        self.retry_after = retry_after
        # Liveness of a worker (heartbeats on IPFS); a dead one fails its requests at once.
        self.alive = alive
        # The largest request each worker reads (None: no limit known); a larger one is
        # refused here, before it is sent, rather than dropped there while we wait.
        self.message_limit = message_limit
        # Told that a worker is lost; describes the values gone with it, for WorkerLost.
        self.on_lost = on_lost
        self.frees: dict[str, list[int]] = {w: [] for w in workers}
        # How long each plan's runs, and each kind of request to each worker, took: a small
        # request whose reply is late by far more is sent again then, once, before
        # retry_after (exec/resend.py).
        self._answer_times = resend.AnswerTimes()
        # Request ids: unique within the session (a worker keeps its records per session),
        # and cheaper than a uuid4 per request, whose os.urandom call also let another
        # thread take the interpreter lock in the middle of a send.
        self._request_numbers = itertools.count(1)  # (ids are these in hex, under _cv)
        self._last_number = 0
        self._unacked: dict[str, dict[int, None]] = {w: {} for w in workers}
        self._acked_above: dict[str, set[int]] = {w: set() for w in workers}
        self._last_in_order: dict[str, int] = {}  # per worker, the latest run's number
        self._heard: dict[str | None, float] = {}  # identity -> when it last replied
        self._replies: dict[str, dict] = {}
        # request id -> (the identity it is sealed for and only it may answer, payload to
        # resend, the ids it frees)
        self._outstanding: dict[str, tuple[str | None, bytes, list[int]]] = {}
        # request id -> an unawaited batch of frees, until its reply (under _cv)
        self._free_batches: dict[str, _FreeBatch] = {}
        self._cv = threading.Condition()
        # the identities requests went to: a message from any other is dropped undecoded
        self._repliers: set[str | None] = set()
        # the request ids each waiting call needs (under _cv): a reply wakes a waiter only
        # once all of its replies are in, so that on a local grid a step's first reply does
        # not take the interpreter lock from the workers still running it
        self._waiting: list[set[str]] = []
        transport.subscribe(topic, self._on_reply)

    # --- frees -----------------------------------------------------------------------------

    def free(self, released: Mapping[str, list[int]]) -> None:
        """Free these value ids (worker -> ids) with the next request to each worker; to a
        worker for which FREE_BATCH or more wait, they go now, in a batch of their own."""
        with self._cv:
            for w, ids in released.items():
                self.frees.setdefault(w, []).extend(ids)
        for w, ids in self.frees.items():
            if len(ids) >= FREE_BATCH:
                self.send(w, {"kind": "free"}, awaited=False)

    def free_later(self, worker: str, ids: list[int]) -> None:
        """Free these value ids with the next request to `worker`, however few."""
        with self._cv:
            self.frees.setdefault(worker, []).extend(ids)

    def close(self) -> None:
        """Forget the batches of frees awaiting replies (the session ended: its worker freed
        all)."""
        with self._cv:
            for rid, batch in self._free_batches.items():
                self._done(batch.worker, rid)
            self._free_batches.clear()

    def add_worker(self, worker: str, fresh: bool = False) -> None:
        """Take requests to `worker` from now on. `fresh`: a new process under a name known
        here: nothing sent to the old one is pending there (its frees, its runs' order)."""
        with self._cv:
            self.frees.setdefault(worker, [])
            self._unacked.setdefault(worker, {})
            self._acked_above.setdefault(worker, set())
            if fresh:
                self.frees[worker] = []
                self._last_in_order.pop(worker, None)

    # --- requests --------------------------------------------------------------------------

    def call(self, worker: str, msg: dict, counted: bool = True) -> dict:
        """Send one request and wait for its reply; raises RemoteError on an error reply."""
        rid = self.send(worker, msg, counted)
        reply = self.wait(("request", msg["kind"], worker), {worker: rid})[worker]
        if not reply.get("ok"):
            error = reply.get("error", {})
            if error.get("code") in SESSION_GONE:
                raise SessionLost(worker, str(error.get("message")))
            raise RemoteError(worker, msg["kind"], str(error.get("message", error)))
        return reply

    def send(
        self,
        worker: str,
        msg: dict,
        counted: bool = True,
        awaited: bool = True,
        in_order: bool = False,
    ) -> str:
        """Send a request; its id. One not `awaited` (a batch of frees) is not kept for
        resending (kept, each stayed for ever, with its reply): its reply only tells whether
        its ids were freed (`_free_batches`). One `in_order` (a run) names the one sent
        `in_order` to the same worker before it (`after`): the worker serves them in the
        order sent."""
        if worker not in self._unacked:  # (a worker this client was not made with)
            self.add_worker(worker)
        refile = bool(self._free_batches) and self.alive(worker)  # (see _refile_frees)
        with self._cv:  # (another thread's reply may put frees back meanwhile)
            if refile:
                self._refile_frees(worker)
            frees, self.frees[worker] = self.frees[worker], []
            number = self._last_number = next(self._request_numbers)
            self._unacked[worker][number] = None  # (numbers go in in order, under _cv)
            ack = self._ack(worker)
            if in_order:
                msg = {**msg, "after": self._last_in_order.get(worker, 0)}
                self._last_in_order[worker] = number
        rid = f"{number:x}"
        msg = {**msg, "id": rid, "session": self.session, "free": frees, "ack": ack}
        payload = wire.encode(msg)
        limit = self.message_limit(worker)
        if limit is not None and len(payload) > limit:
            with self._cv:  # never sent: nothing waits for it, and no run comes after it
                self.frees[worker][:0] = frees  # (they go with the next request)
                self._done(worker, rid)
                if in_order and self._last_in_order.get(worker) == number:
                    self._last_in_order[worker] = msg["after"]
            raise GridError(
                f"this {msg['kind']!r} request is {len(payload) / MiB:.1f} MiB, over the "
                f"{limit / MiB:.1f} MiB worker {worker!r} reads (it would drop it unread); "
                + _TOO_LARGE.get(msg["kind"], "")
            )
        topic = worker_topic(worker)
        identity = self.transport.recipient(topic)  # looked up once: the reply must match it
        self._repliers.add(identity)
        with self._cv:  # (before it is sent: on a local grid the reply may come first)
            if awaited:
                self._outstanding[rid] = (identity, payload, frees)
            elif frees:
                self._free_batches[rid] = _FreeBatch(worker, identity, frees, time.monotonic())
            else:
                self._done(worker, rid)
        try:
            self.transport.publish(topic, payload, counted, identity)
        except NotSent:  # as a message lost: its wait sends it again (a batch of frees:
            pass  # its ids go again once it is long unanswered)
        except BaseException as error:  # (the transport is closed): nothing will wait for it
            with self._cv:
                if self._outstanding.pop(rid, None) or self._free_batches.pop(rid, None):
                    self.frees[worker].extend(frees)
                    self._done(worker, rid)
            if isinstance(error, Exception) and self.gone(worker):  # (Kubo's HTTP 500 ...)
                raise WorkerLost(worker, self.on_lost(worker), LOST_HINT) from error
            raise
        return rid

    def _refile_frees(self, worker: str) -> None:
        """Put back into `frees` (under _cv) the ids of the batches of frees to `worker`
        that were refused, or whose reply has not come within retry_after (lost, most
        likely: if it was only late, the ids are freed twice, and the second time frees
        nothing). Left out, a lost batch's values stayed on the worker until the session
        ended. `send` calls it only for a worker alive: to one that looks gone (on IPFS, no
        heartbeat for a while) each batch would carry all the earlier ones again; kept,
        they go if it comes back."""
        now = time.monotonic()
        for rid, batch in list(self._free_batches.items()):
            if batch.worker == worker and (batch.refused or now - batch.sent_at > self.retry_after):
                del self._free_batches[rid]
                self.frees[worker].extend(batch.ids)
                self._done(worker, rid)

    def _ack(self, worker: str) -> dict:
        """(under _cv) What a request to `worker` acknowledges (protocol.py): the ids under
        the least one whose reply is still needed, and up to MAX_ACK_IDS above it."""
        unacked = self._unacked[worker]
        below = next(iter(unacked)) if unacked else self._last_number + 1
        above = self._acked_above[worker]
        if any(n < below for n in above):
            above -= {n for n in above if n < below}
        return {"below": below, "ids": sorted(above)[:MAX_ACK_IDS]}

    def _done(self, worker: str, rid: str) -> None:
        """(under _cv) The client no longer needs request `rid`'s reply from `worker`."""
        number = int(rid, 16)
        if self._unacked[worker].pop(number, 1) is None:
            self._acked_above[worker].add(number)

    def _sent(self, rid: str) -> bytes:
        """The payload of outstanding request `rid`, as sent."""
        return self._outstanding[rid][1]

    def wait(
        self, key: Hashable, rids: dict[str, str], sent_at: float | None = None
    ) -> dict[str, dict]:
        """`wait_all(rids)`, where `key` names what the requests are (a plan; a kind of
        request to a worker): a small request is first sent again after what the earlier
        answers to `key` took, if that is sooner than retry_after (exec/resend.py). Times
        count from `sent_at` (time.monotonic() when they were sent; by default now): a run
        not waited for at once is not asked again as if just sent."""
        learned = self._answer_times.wait(key, self.retry_after)
        early = {w: learned for w, rid in rids.items() if resend.may_ask_early(self._sent(rid))}
        start = time.monotonic() if sent_at is None else sent_at
        replies = self.wait_all(rids, early, start)
        self._answer_times.observe(key, time.monotonic() - start)
        return replies

    def wait_all(
        self,
        rids: dict[str, str],
        early: dict[str, float] | None = None,
        sent_at: float | None = None,
    ) -> dict[str, dict]:
        """The replies to several requests (worker -> request id), resending each while its
        reply does not come: after `retry_after` s, then after twice as long each time, but
        first after `early[worker]` s where given (exec/resend.py), counted from `sent_at`
        (by default now). All at once: a worker may wait on another's lost request."""
        waited = time.monotonic()  # (the timeout counts from here: a run queued behind
        start = waited if sent_at is None else sent_at  # others is not late for that)
        retry = {w: self.retry_after for w in rids}
        due = {w: start + (early or {}).get(w, self.retry_after) for w in rids}
        needed = set(rids.values())
        with self._cv:
            self._waiting.append(needed)
        try:
            while True:
                with self._cv:
                    waiting = [w for w, rid in rids.items() if rid not in self._replies]
                    if not waiting:
                        return self._take_replies(rids)
                # Resent without the lock: a publish may take a while (on IPFS, a call to
                # Kubo), and every reply, to any waiting thread, is taken under it.
                now = time.monotonic()
                for w in waiting:
                    if not self.alive(w) and not self._heard_lately(rids[w], now):
                        raise WorkerLost(w, self.on_lost(w), LOST_HINT)
                    if now >= due[w]:
                        identity, payload, _ = self._outstanding[rids[w]]
                        # ipfs: recovery traffic is not counted: stats do not depend on losses
                        with contextlib.suppress(NotSent):  # (lost again: sent again later)
                            self.transport.publish(worker_topic(w), payload, False, identity)
                        retry[w] = min(2 * retry[w], 8 * self.retry_after)  # lost, or slow
                        due[w] = now + retry[w]
                if now - waited > self.timeout:
                    raise GridError(f"worker {waiting[0]!r} did not answer in {self.timeout} s")
                with self._cv:  # (a reply that came meanwhile is not waited for)
                    waiting = [w for w, rid in rids.items() if rid not in self._replies]
                    if waiting:  # (and at least every 0.25 s, to notice a worker gone)
                        next_due = min(due[w] for w in waiting) - time.monotonic()
                        self._cv.wait(min(0.25, max(0.0, next_due)))
        except BaseException:  # (timed out, a worker lost, interrupted)
            with self._cv:
                self._put_frees_back(rids)
            raise
        finally:
            with self._cv:
                self._waiting.remove(needed)
                for w, rid in rids.items():
                    self._outstanding.pop(rid, None)
                    self._replies.pop(rid, None)
                    self._done(w, rid)

    def abandon(self, rids: dict[str, str]) -> None:
        """Give up on these requests (worker -> id) without waiting (a cancel): their frees
        go with the next request to their worker, their replies are acknowledged."""
        with self._cv:
            self._put_frees_back(rids)
            for w, rid in rids.items():
                if self._outstanding.pop(rid, None) is not None:
                    self._done(w, rid)
                self._replies.pop(rid, None)

    def gone(self, worker: str) -> bool:
        """Whether a request to `worker` would fail at once as lost: `alive` says it is gone
        and it has not replied within HEARD_ALIVE s."""
        if self.alive(worker):
            return False
        heard = self._heard.get(self.transport.recipient(worker_topic(worker)), -math.inf)
        return time.monotonic() - heard >= HEARD_ALIVE

    def _heard_lately(self, rid: str, now: float) -> bool:
        """Whether the worker request `rid` went to answered any request within HEARD_ALIVE
        s: a worker that replies is alive, whatever its heartbeats (on Kubo under load,
        announcements are lost with the rest, and a live worker was taken for lost)."""
        identity = self._outstanding[rid][0]
        return now - self._heard.get(identity, -math.inf) < HEARD_ALIVE

    def _take_replies(self, rids: dict[str, str]) -> dict[str, dict]:
        """The replies to `rids`, all in (under _cv). An error names the worker it came
        from, whatever it says (a hostile or broken one could name another, or none)."""
        self._put_frees_back(rids)
        replies = {w: self._replies.pop(rid) for w, rid in rids.items()}
        for w, reply in replies.items():
            if not reply["ok"]:
                reply["error"]["worker"] = w
        return replies

    def _put_frees_back(self, rids: dict[str, str]) -> None:
        """(under _cv) The frees of the requests among `rids` that freed nothing go with
        the next request to their worker: those refused (`_freed_nothing`), and those with
        no reply when their wait ended, which may never have reached it (freeing twice
        frees nothing)."""
        for w, rid in rids.items():
            reply, outstanding = self._replies.get(rid), self._outstanding.get(rid)
            if outstanding is not None and (reply is None or _freed_nothing(reply)):
                self.frees[w].extend(outstanding[2])

    def _on_reply(self, sender: str, payload: bytes) -> None:
        if sender not in self._repliers:  # (before decoding: anyone may publish here)
            return
        try:
            msg = wire.decode(payload)
        except wire.WireError:
            return
        rid = msg.get("re")
        if msg.get("kind") != "reply" or type(rid) is not str:
            return
        msg["ok"] = msg.get("ok") is True  # (a worker may be broken or hostile: what the
        if not msg["ok"]:  # client reads of an error is made plain data here, once)
            error = msg.get("error")
            if not isinstance(error, dict):
                error = {"message": "a malformed error reply"}  # (_take_replies names its worker)
            code = error.get("code")
            error["code"] = code if isinstance(code, str) else None
            error["refused"] = error.get("refused") is True
            error["upstream"] = error.get("upstream") is True
            msg["error"] = error
        with self._cv:  # (with the waiter's clean-up: a late reply is not kept for ever)
            batch = self._free_batches.get(rid)
            if batch is not None:
                if sender == batch.identity:  # (from the worker it went to, as below)
                    if _freed_nothing(msg):
                        batch.refused = True  # its ids go with the next request
                    else:
                        self._free_batches.pop(rid, None)
                        self._done(batch.worker, rid)
                return
            outstanding = self._outstanding.get(rid)
            if outstanding is None or sender != outstanding[0]:
                return  # not awaited, or not from the worker the request went to
            self._heard[sender] = time.monotonic()
            self._replies[rid] = msg
            if any(needed <= self._replies.keys() for needed in self._waiting):
                self._cv.notify_all()


_TOO_LARGE = {
    "run": "a local tensor mixed into an op travels with the run: send large ones first "
    "(gg.send(t, worker) splits what is over the limit)",
    "put": "gg.send splits large tensors: send them one call each",
}


def _freed_nothing(reply: dict) -> bool:
    """Whether the request `reply` answers was refused by a session that goes on, so that
    its frees must go again (one whose session ended or was lost: its worker freed all)."""
    if reply.get("ok"):
        return False
    error = reply["error"]  # (a map: `_on_reply` saw to it)
    return bool(error.get("refused")) and error.get("code") not in SESSION_GONE
