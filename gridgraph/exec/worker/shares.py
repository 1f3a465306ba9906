"""A worker's executor places, shared fairly among its peers rather than first come.

State: none of its own. Who holds a place is read from the worker's sessions: a session
holds one while its executor process lives (`Session.executor`) or is being started
(`Session.starting`, set under the worker's lock on places, so that sessions starting at
once are counted against their peer's share).

Policy (`make_place`, before a session starts its executor):
- a peer may take a place while it holds fewer than its fair share of `max_executors`
  (`budget.fair_share` among the peers holding one, itself included, plus one), so that the
  peers who came first leave places for one who comes last;
- when none is free, an idle session that stores nothing (its executor holds no bytes, and
  its random stream was never seeded) of the peer holding the most places, more than the
  asker, gives its place up: its executor ends, and starts again at its next request; nothing
  of it is lost. A session that stores something keeps its place until its bye or its lease:
  ending it would lose its client's tensors. Past that, the session is refused until a place
  is free (`Isolation.start` says so, naming max_executors).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable

from gridgraph.exec.safety.budget import fair_share
from gridgraph.exec.safety.limits import LimitExceeded
from gridgraph.exec.worker.session import Session

log = logging.getLogger("gridgraph.worker")


def holders(sessions: Iterable[Session]) -> Counter[str]:
    """Executor places held, per peer."""
    return Counter(s.peer for s in sessions if _holds_place(s))


def make_place(session: Session, sessions: list[Session], places: int) -> None:
    """Make sure `session` may start an executor in one of `places`: within its peer's fair
    share (else LimitExceeded), and a place freed if none is (see the module docstring)."""
    held = holders(sessions)
    share = fair_share(places, len(held.keys() | {session.peer}))
    mine = held[session.peer]
    if mine >= share:
        raise LimitExceeded(
            f"your peer already runs {mine} sessions in executor processes here, its fair "
            f"share of this worker's {places} (max_executors) among the {len(held)} peers "
            f"using them; end one (bye), or try again once other peers' sessions end"
        )
    if sum(held.values()) < places:
        return
    for other in sorted(sessions, key=lambda s: (-held[s.peer], s.last_seen)):
        if held[other.peer] <= mine + 1:
            return  # (every peer left holds no more than this one would)
        if other.peer != session.peer and _give_up_place(other):
            log.info("client %s gave its executor place to %s: its peer held %d, and it "
                     "stored nothing", other.key, session.key, held[other.peer])  # fmt: skip
            return


def _holds_place(session: Session) -> bool:
    """Whether `session` holds a place: its executor lives, or is being started."""
    return session.starting or session.executor is not None and session.executor.lost is None


def _give_up_place(session: Session) -> bool:
    """End the executor of `session` if it is idle and stores nothing; whether it did."""
    with session.cv:
        if session.busy or session.closed or not _holds_place(session):
            return False
        if session.elsewhere or session.seeded:
            return False
        executor, session.executor = session.executor, None
    executor.close()
    return True
