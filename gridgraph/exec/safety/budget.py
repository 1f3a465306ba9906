"""The network process's memory budget: what it holds for each peer, and in all.

State: bytes held per peer (the unit of every per-peer limit: the transport's `owner` of a
sender, on IPFS the Kubo node whose key signs its messages) and their sum.

Policy: whatever a peer makes a worker's network process hold (its requests waiting to run
and their records, replies waiting to be sent (worker/outbox.py), transfers no run of the
receiving session named, block payloads being fetched, and whatever else a caller charges)
is charged to that peer before it is kept, and released when it goes. A charge is granted
only if the peer stays within its share, `cap // shares` (`Limits.peer_shares`; under the
default cap, at least one largest message: `MemoryBudget.of`; a caller may let a charge go
a stated number of bytes past it, `beyond`), and the total within `cap`; else nothing is
charged, and the caller refuses what it would have kept (`refusal` says which limit, and
what to do).
A fixed share, not first come: however much fewer than `shares` peers send, every other
peer keeps its share.

`fair_share` is the rule for pools of slots (block assemblers, executor places): a peer may
hold at most an equal part of the pool among the peers using it plus one, so that a peer
arriving last still finds a slot free.
"""

from __future__ import annotations

import logging
import threading

from gridgraph.exec.safety.limits import (
    MACHINE_PART,
    RECORD_BYTES,
    TRANSFER_BYTES,
    LimitExceeded,
    Limits,
    format_size,
    machine_memory,
)

log = logging.getLogger("gridgraph.worker")

# Bytes charged for a request waiting in a session's queue, beside its payload (the queue's
# tuple, the bytes object's header, its share of the deque).
QUEUED_BYTES = 300


def fair_share(pool: int, peers: int) -> int:
    """Slots of a pool of `pool` one of `peers` peers using it may hold: an equal part among
    them and one more (a newcomer), at least one.

    >>> fair_share(32, 8)
    3
    """
    return max(1, pool // (max(peers, 1) + 1))


class MemoryBudget:
    """Bytes a network process holds per peer, within `cap` in all and `cap // shares` per
    peer (None: no cap). See the module docstring.

    Example:
        budget = MemoryBudget(1 << 30)
        if budget.charge(peer, len(payload)):
            ...  # keep it; budget.release(peer, len(payload)) once it goes
    """

    def __init__(self, cap: int | None, shares: int = 16, least: int = 0) -> None:
        if cap is not None and cap <= 0:
            raise ValueError(f"a worker's memory cap must be positive, got {cap}")
        if shares < 1:
            raise ValueError(f"a memory budget needs at least one share, got {shares}")
        self.cap, self.shares = cap, shares
        # (`least`: a share of at least that many bytes, within the cap)
        self.share = None if cap is None else min(cap, max(cap // shares, least))
        self._held: dict[str, int] = {}
        self._total = 0
        self._lock = threading.Lock()

    @classmethod
    def of(cls, limits: Limits) -> MemoryBudget:
        """The budget `limits` grant (max_worker_memory, peer_shares). Under the default cap
        (a MACHINE_PART of the machine) a peer's share holds at least one largest message
        (max_message_bytes and what is kept with it), so that a worker on a small machine
        takes every message it accepts; fewer peers can then fill the cap. A cap set by hand
        is taken as given, with a warning if a share is below max_message_bytes (a message
        that large would be refused; over IPFS dropped unanswered)."""
        cap, least = limits.max_worker_memory, 0
        if cap is not None and cap == machine_memory() // MACHINE_PART:
            least = limits.max_message_bytes + QUEUED_BYTES + RECORD_BYTES + TRANSFER_BYTES
        budget = cls(cap, limits.peer_shares, least)
        if budget.share is not None and budget.share < limits.max_message_bytes:
            log.warning(
                "each peer's share of this worker's memory is %s (max_worker_memory / %d), "
                "under the largest message it takes, %s (max_message_bytes): larger requests "
                "will be refused; raise --max-worker-memory to %s or more to take them",
                format_size(budget.share), budget.shares, format_size(limits.max_message_bytes),
                format_size(limits.max_message_bytes * budget.shares),
            )  # fmt: skip
        return budget

    def charge(self, peer: str, nbytes: int, within: int | None = None, beyond: int = 0) -> bool:
        """Charge `peer` `nbytes` more; False, and nothing charged, past its share (and
        `beyond` bytes more: room a caller keeps for what tells the peer it is past it),
        the cap, or `within` bytes held by the peer in all (a caller's own limit)."""
        with self._lock:
            held = self._held.get(peer, 0) + nbytes
            if within is not None and held > within or not self._fits(peer, nbytes, beyond):
                return False
            self._held[peer] = held
            self._total += nbytes
            return True

    def fits(self, peer: str, nbytes: int) -> bool:
        """Whether `peer` could be charged `nbytes` more now (within its share and the cap)."""
        with self._lock:
            return self._fits(peer, nbytes)

    def _fits(self, peer: str, nbytes: int, beyond: int = 0) -> bool:
        if self.cap is None:
            return True
        held = self._held.get(peer, 0) + nbytes
        return held <= self.share + beyond and self._total + nbytes <= self.cap

    def release(self, peer: str, nbytes: int) -> None:
        """Stop charging `peer` for `nbytes` it was charged."""
        with self._lock:
            left = self._held.get(peer, 0) - nbytes
            self._total -= nbytes + min(left, 0)  # (never below what was charged)
            if left > 0:
                self._held[peer] = left
            else:
                self._held.pop(peer, None)

    def held(self, peer: str | None = None) -> int:
        """What `peer` is charged now; with no peer, what all are."""
        with self._lock:
            return self._total if peer is None else self._held.get(peer, 0)

    def peers(self) -> int:
        """Peers charged anything now."""
        with self._lock:
            return len(self._held)

    def refusal(self, peer: str, nbytes: int, what: str) -> LimitExceeded:
        """The error for `what`, `nbytes` that `charge` refused `peer` within its share or
        the cap: which limit, and what to do."""
        with self._lock:
            held, total = self._held.get(peer, 0), self._total
        if self.share is not None and held + nbytes > self.share:
            return LimitExceeded(
                f"{what} ({format_size(nbytes)}) would take your peer past its share of this "
                f"worker's memory, {format_size(self.share)} (max_worker_memory / "
                f"{self.shares} peers): its network process holds {format_size(held)} for "
                f"your peer already; wait for the replies to your earlier requests, then send "
                f"it again"
            )
        return LimitExceeded(
            f"{what} does not fit: this worker's network process holds {format_size(total)} "
            f"for its peers, and its cap is {format_size(self.cap or 0)} (max_worker_memory); "
            f"try again later, or use another worker"
        )
