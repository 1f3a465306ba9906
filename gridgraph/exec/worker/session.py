"""One client session on a worker: everything the worker keeps for it, and its memory.

A client is an authenticated peer plus the session id it chose; everything a worker keeps
for it lives in its `Session` and nowhere else, so no other peer can read, evict, reseed or
reset any of it:

    work       what its programs run on: tensors, prepared programs, random stream
               (workspace.py; with isolation, the one in its executor process counts)
    records    request id -> its reply once sent: a request id runs at most once. A reply is
               kept until the client acknowledges it (protocol.py, `ack` in each request),
               within REPLY_BYTES_KEPT a session and what the peer's memory budget grants
               (past either the oldest go, never the latest: one the budget cannot take is
               kept uncharged, `Record.charged`, so that only what was charged is released);
               bare ids for the RECORDS_KEPT latest, and none under the watermark
               `acked_below`: a request under it that has no record is an old copy, refused
               as already served
    reply_topic  where its client hears replies (protocol.client_topic of the sender)
    traffic    messages and bytes the worker sent for it
    sent       transfers it sent, kept for resending (ipfs) to the identity they went to
    inbox      transfers sent to it, by (run, first value id, sending worker) and sender
               identity, as received (decoded only when a run takes one); charged to the
               session when its runs named the sender (`named`), else to the sender
    queue      its requests waiting to run, in arrival order (`queued_bytes` of them)
    held       runs that came before the run their client sent this worker ahead of them
               (`after`, protocol.py): held, counted in `queued_bytes`, until that one is
               recorded here or acknowledged, so runs are served in the order they were sent

All of it counts against the session's memory limit (`memory()`); what the worker charged its
peer in its memory budget (budget.py: records, replies, queue, inbox, sent) goes back through
`release`.
All of it goes when the client says `bye` or its lease expires; `EndedSessions` remembers why
a session ended. How a request is served: run.py.
"""

from __future__ import annotations

import heapq
import logging
import math
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any

from gridgraph.exec.protocol import MAX_ACK_IDS, SESSION_LOST, is_name, request_number
from gridgraph.exec.safety.budget import QUEUED_BYTES
from gridgraph.exec.safety.droplog import DropLog
from gridgraph.exec.safety.limits import (
    RECORD_BYTES,
    TRANSFER_BYTES,
)
from gridgraph.exec.transport import TrafficCounter
from gridgraph.exec.worker.workspace import Workspace

log = logging.getLogger("gridgraph.worker")
_drops = DropLog(log)

NAMED_KEPT = 256  # identities of workers a session's runs named, the latest kept
# Bytes of unacknowledged replies kept per session, to answer a resent request again: past
# it the oldest go (a resend of one then says so), never the latest. (A client keeps its
# replies far under it: it bounds the runs it has in flight.)
REPLY_BYTES_KEPT = 64 * 2**20
RECORDS_KEPT = 100_000  # latest request ids remembered per session (~RECORD_BYTES each)
TRANSFERS_KEPT = 1024  # ipfs: transfers kept per session for resending, and received ids
# Ended sessions remembered (EndedSessions): per peer, and peers, the latest ones.
ENDED_KEPT = 64
ENDED_PEERS = 1024


class RequestError(Exception):
    """A request that cannot be served; its message goes back to the sender."""

    def __init__(self, message: str, code: str = "refused") -> None:
        super().__init__(message)
        self.code = code


class ExecutorLost(Exception):
    """A session's executor process is gone, and what it held with it; `str(e)` says why."""

    code = SESSION_LOST


# Why a record no longer holds its reply (`Record.dropped`).
ACKNOWLEDGED = "its client acknowledged it"
OVER_BYTES = (
    f"the session's unacknowledged replies held over {REPLY_BYTES_KEPT // 2**20} MiB here "
    f"(REPLY_BYTES_KEPT), and it was the oldest"
)
FORGOTTEN = "it was among the oldest of over RECORDS_KEPT requests"
OVER_BUDGET = (
    "what its peer may make this worker's network process hold (its share of "
    "max_worker_memory) was full, and it was the oldest"
)


class Record:
    """What a session remembers of one request: its reply once sent, and when it went out."""

    __slots__ = ("reply", "sent_at", "resent", "dropped", "charged")

    def __init__(self) -> None:
        self.reply: bytes | None = None  # None: queued or running, or the reply was dropped
        self.sent_at = math.inf  # monotonic time its latest copy went out (inf until one did)
        self.resent = 0  # times the reply was sent again (worker.RESENDS, then paced)
        self.dropped: str | None = None  # why the reply is no longer kept, once it is not
        self.charged = False  # its reply's bytes are charged to the peer's memory budget


class Session:
    """Everything a worker keeps for one client; see the module docstring."""

    def __init__(self, key: str, peer: str) -> None:
        self.key, self.peer = key, peer
        # Where its client hears replies (worker.client_topic of the sender and session id of
        # its requests): set by the worker when it accepts one, never named by a request.
        self.reply_topic = ""
        # The identity whose transfer opened it, until its client's first request (worker.py)
        self.opened_by: str | None = None
        self.work = Workspace()
        self.records: OrderedDict[str, Record] = OrderedDict()
        self.traffic = TrafficCounter()
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
        # What the worker charges `peer` in its memory budget (budget.py), and gives back.
        self.charge: Callable[[int], bool] = lambda nbytes: True
        self.release: Callable[[int], None] = lambda nbytes: None
        self.fits: Callable[[int], bool] = lambda nbytes: True  # (would it be charged now)
        self.received: OrderedDict[tuple[int, int, str], None] = OrderedDict()
        self.aborted: OrderedDict[Any, None] = OrderedDict()  # runs the client gave up on
        self.aborted_upto = 0  # and every run numbered up to this, if positive (a cancel)
        # (request, or None until served if it came while others waited; arrival; payload)
        self.queue: deque[tuple[dict | None, float, bytes]] = deque()
        self.queued_bytes = 0  # of the payloads in `queue` and `held`
        # the request id number of the run each waits for -> [(its id, its queue entry)]
        self.held: dict[int, list[tuple[str, tuple[dict | None, float, bytes]]]] = {}
        self._held_numbers: set[int] = set()  # the id numbers of the runs held
        self.busy = False  # a request is queued or running
        self.busy_seconds = 0.0  # spent serving its requests since its last stats reset
        self.serving = False  # a thread serves the queue (running, or waiting for more)
        self.closed = False
        self.last_seen = time.monotonic()
        self.cv = threading.Condition()  # guards inbox, received, aborted, closed
        # the process running its programs (isolation/executor.py), if any
        self.executor: Any = None
        self.starting = False  # its executor is being started (it holds a place: shares.py)
        self.elsewhere = 0  # bytes the other process (worker or executor) holds for it
        self.seeded = False  # a seed request came: its random stream is its own (shares.py)
        self._reply_bytes = 0
        # records that got a reply, oldest first (some may have let it go since: skipped)
        self._with_reply: deque[Record] = deque()
        self._holding = 0  # records holding a reply
        # Acknowledged: every request id numbered under this (protocol.request_number)
        self.acked_below = 0
        self._numbered: list[tuple[int, str]] = []  # heap: (number, id) of numbered records
        self._inbox_bytes = 0
        self._sent_bytes = 0

    # --- memory ----------------------------------------------------------------------------

    def memory(self) -> int:
        """Bytes this session holds: its workspace, inbox, kept transfers, replies, records,
        and what the other process (worker or executor) holds for it."""
        return (
            self.work.memory()
            + self._inbox_bytes
            + self._sent_bytes
            + self._reply_bytes
            + RECORD_BYTES * len(self.records)
            + self.elsewhere
        )

    # --- request records -------------------------------------------------------------------

    def record(self, rid: str) -> Record:
        """A new record for request `rid`, dropping the oldest ones past the caps."""
        rec = self.records[rid] = Record()
        number = request_number(rid)
        if number is not None:
            heapq.heappush(self._numbered, (number, rid))
        while len(self.records) > RECORDS_KEPT:
            _, old = self.records.popitem(last=False)
            self.release(RECORD_BYTES)
            self._drop_reply(old, FORGOTTEN)
        if len(self._numbered) > 2 * RECORDS_KEPT:  # (ids of records dropped above)
            self._numbered = [(n, r) for n, r in self._numbered if r in self.records]
            heapq.heapify(self._numbered)
        return rec

    def stale(self, rid: str) -> bool:
        """Whether `rid` is under the acknowledged watermark with no record: its reply was
        acknowledged (or its client gave up on it), so this is an old copy."""
        number = request_number(rid)
        return number is not None and number < self.acked_below and rid not in self.records

    def acknowledge(self, ack: Any) -> None:
        """Let go of the replies `ack` (a request's, protocol.py) says its client no longer
        needs: the records under its watermark go whole (the watermark refuses their
        copies), those listed keep their bare id. Whatever else a request asks, this only
        lets go of what its own client was keeping here; a malformed `ack` is ignored."""
        if not isinstance(ack, dict):
            return
        below, ids = ack.get("below"), ack.get("ids")
        if type(below) is int and self.acked_below < below <= 2**64:
            self.acked_below = below
            while self._numbered and self._numbered[0][0] < below:
                _, rid = heapq.heappop(self._numbered)
                rec = self.records.pop(rid, None)
                if rec is not None:
                    self.release(RECORD_BYTES)
                    self._drop_reply(rec, ACKNOWLEDGED)
        if isinstance(ids, list) and len(ids) <= MAX_ACK_IDS:
            for number in ids:
                if type(number) is int and 0 < number <= 2**64:
                    rec = self.records.get(format(number, "x"))
                    if rec is not None:
                        self._drop_reply(rec, ACKNOWLEDGED)

    def replied(self, rec: Record, reply: bytes) -> None:
        """Keep `reply` for resends until it is acknowledged, charged to the peer's memory
        budget and within REPLY_BYTES_KEPT: past either the oldest unacknowledged replies
        go, never this one (exactly once needs it; kept uncharged if the budget cannot take
        it even then). A queue of the records that got one: this costs the same after a
        million requests."""
        rec.reply = reply
        self._reply_bytes += len(reply)
        self._holding += 1
        self._with_reply.append(rec)
        rec.charged = self.charge(len(reply))
        while not rec.charged and self._with_reply[0] is not rec:
            self._drop_reply(self._with_reply.popleft(), OVER_BUDGET)
            rec.charged = self.charge(len(reply))
        while self._reply_bytes > REPLY_BYTES_KEPT and self._with_reply[0] is not rec:
            self._drop_reply(self._with_reply.popleft(), OVER_BYTES)
        if len(self._with_reply) > 2 * self._holding + 64:  # most let go of theirs since
            self._with_reply = deque(r for r in self._with_reply if r.reply is not None)

    def _drop_reply(self, rec: Record, why: str) -> None:
        if rec.reply is not None:
            self._reply_bytes -= len(rec.reply)
            self._holding -= 1
            if rec.charged:
                self.release(len(rec.reply))
                rec.charged = False
            rec.reply = None
            rec.dropped = why

    # --- runs in the order sent ------------------------------------------------------------

    def in_turn(self, after: Any) -> bool:
        """Whether a run that names `after` (the id number of the run its client sent this
        worker before it; none, or not a positive int: no order) may be queued now: that
        run is recorded here (queued, served or refused) or acknowledged."""
        if type(after) is not int or after <= 0:
            return True
        if after < self.acked_below:
            return True
        return format(after, "x") in self.records and after not in self._held_numbers

    def hold(self, after: int, rid: str, entry: tuple[dict | None, float, bytes]) -> None:
        """Hold a run until the one it names (`after`) is queued or acknowledged."""
        self.held.setdefault(after, []).append((rid, entry))
        number = request_number(rid)
        if number is not None:
            self._held_numbers.add(number)

    def in_turn_now(self, rid: str) -> list[tuple[dict | None, float, bytes]]:
        """The held runs that may be queued now that request `rid` was: those waiting for it,
        and for them in turn, and those waiting for a run since acknowledged."""
        ready, done = [], [rid]
        for after in sorted(a for a in self.held if a < self.acked_below):
            done.extend(r for r, _ in self.held[after])
            ready.extend(e for _, e in self.held.pop(after))
        while done:
            number = request_number(done.pop(0))
            self._held_numbers.discard(number)
            for r, entry in self.held.pop(number, ()) if number is not None else ():
                ready.append(entry)
                done.append(r)
        return ready

    def take_held(self) -> list[tuple[dict | None, float, bytes]]:
        """Every held run, no longer held (its session ends or fails its queue)."""
        held = [entry for waiting in self.held.values() for _, entry in waiting]
        self.held.clear()
        self._held_numbers.clear()
        return held

    # --- transfers -------------------------------------------------------------------------

    def keep_sent(
        self, key: tuple[int, int, str], peer: str, payload: bytes, cap: int | None = None
    ) -> None:
        """Keep a transfer this session sent to identity `peer`, for a resend (ipfs): the
        TRANSFERS_KEPT latest, within the room the rest of the session's memory leaves
        under `cap` (None: no limit) and that the worker's memory budget grants (`charge`).
        The oldest go first; one larger than that room is not kept (it cannot be sent
        again)."""
        _, old, _ = self.sent.pop(key, ("", b"", 0))
        self._sent_bytes -= len(old)
        self.release(len(old))
        room = None if cap is None else cap - (self.memory() - self._sent_bytes)
        if room is not None and len(payload) > room:
            return
        if not self.fits(len(payload) - self._sent_bytes):  # (not even with none kept)
            return
        while not self.charge(len(payload)):
            if not self.sent:
                return
            self._drop_oldest_sent()
        self.sent[key] = [peer, payload, 0]
        self._sent_bytes += len(payload)
        while len(self.sent) > TRANSFERS_KEPT or room is not None and self._sent_bytes > room:
            self._drop_oldest_sent()

    def _drop_oldest_sent(self) -> None:
        _, (_, dropped, _) = self.sent.popitem(last=False)
        self._sent_bytes -= len(dropped)
        self.release(len(dropped))

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
            _drops.warning(other, "client %s: dropped a transfer claiming to come from %s: "
                           "sent by %s, not by the identity its run names", self.key, key[2],
                           other)  # fmt: skip
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
            self.release(len(payload) + TRANSFER_BYTES)

    def abort(self, run: Any, upto: Any = None) -> None:
        """Its client gave up on run `run`, or on every run numbered up to `upto` (a cancel):
        a run waiting in a recv fails at once, one running stops before its next op, one
        queued is answered without running."""
        with self.cv:
            if type(run) is int:
                self.aborted[run] = None
                while len(self.aborted) > TRANSFERS_KEPT:
                    self.aborted.popitem(last=False)
            if type(upto) is int and upto > self.aborted_upto:
                self.aborted_upto = upto
            self.cv.notify_all()

    def is_aborted(self, run: Any) -> bool:
        """Whether its client gave up on run `run` (`abort`)."""
        if type(run) is not int:
            return False
        return run in self.aborted or 0 < self.aborted_upto and run <= self.aborted_upto

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
            held = sum(len(waiting) for waiting in self.held.values())
            self.release(self.queued_bytes + QUEUED_BYTES * (len(self.queue) + held))
            self.release(RECORD_BYTES * len(self.records))
            for rec in self._with_reply:  # (their replies' charges go back)
                self._drop_reply(rec, "its session ended")
            self.queue.clear()
            self.held.clear()
            self._held_numbers.clear()
            self.queued_bytes = 0
            self.records.clear()
            self.cv.notify_all()
        n = self.work.clear()
        if self.executor is not None:
            self.executor.close()
        self._with_reply.clear()
        self._numbered.clear()
        self._holding = 0
        self.release(self._sent_bytes)
        self.sent.clear()
        self._reply_bytes = self._inbox_bytes = self._sent_bytes = 0
        return n


class EndedSessions:
    """Why sessions ended, by key: ENDED_KEPT per peer (a peer's own churn pushes out only
    its own), for the ENDED_PEERS peers that most recently lost one. A worker keeps two: why
    it ended sessions their clients had used (lease, eviction), and which ones their clients
    ended (bye), apart, so that a peer's byes never push out why the worker ended one of its
    sessions. Sessions opened by a transfer and never adopted leave no record."""

    def __init__(self) -> None:
        self._by_peer: OrderedDict[str, OrderedDict[str, str]] = OrderedDict()

    def add(self, session: Session, why: str) -> None:
        if session.opened_by:  # opened by a transfer, never used by its client
            return
        kept = self._by_peer.pop(session.peer, None) or OrderedDict()
        self._by_peer[session.peer] = kept  # the most recent peer last
        kept[session.key] = why
        if len(kept) > ENDED_KEPT:
            kept.popitem(last=False)
        if len(self._by_peer) > ENDED_PEERS:
            self._by_peer.popitem(last=False)

    def why(self, peer: str, key: str) -> str | None:
        kept = self._by_peer.get(peer)
        return kept.get(key) if kept is not None else None
