"""Hostile peers that fill what a worker's network process holds for them, for the tests of
its memory budget and for bench/bench_worker_memory.py.

`flood(arena, peers)` makes `peers` hand-made clients, each with an endpoint of its own, and
has each open `sessions` sessions on the arena's target whose first request is a `recv` that
nobody will satisfy (the session's thread waits in it), then queue `queued` puts of `size`
bytes behind it and send `strays` transfers that no run named (to its own session, and one to
the victim's). `Flood.stop()` aborts the recvs. `rss()` is this process's resident memory.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import psutil
import torch

from gridgraph.exec import wire
from gridgraph.exec.worker.worker import Worker
from tests.exec.hostile import Peer, run
from tests.exec.worker.arena import Arena

MiB = 1 << 20
WAIT_RUN = 7  # the run id of each session's recv


def rss() -> int:
    """This process's resident memory, in bytes."""
    return psutil.Process().memory_info().rss


@dataclass
class Flood:
    """What the hostile peers sent, and the refusals they heard."""

    arena: Arena
    attackers: list[Peer]
    sessions: list[tuple[Peer, str]]
    sent: int = 0  # bytes of puts and transfers sent
    refusals: list[dict] = field(default_factory=list)  # error replies naming the budget

    def collect(self, seconds: float = 0.5) -> None:
        """Gather the replies that came (refusals)."""
        time.sleep(seconds)
        for peer in self.attackers:
            while not peer.replies.empty():
                reply = peer.replies.get_nowait()
                if not reply.get("ok") and "max_worker_memory" in str(reply.get("error")):
                    self.refusals.append(reply)

    def stop(self) -> None:
        """Abort every session's recv: their queued requests then run."""
        for peer, session in self.sessions:
            abort = {"kind": "abort", "run": WAIT_RUN, "session": session}
            peer.publish(self.arena.target, wire.encode(abort))


def flood(
    arena: Arena,
    peers: int = 8,
    sessions: int = 4,
    queued: int = 4,
    strays: int = 4,
    size: int = MiB,
) -> Flood:
    """`peers` hostile peers fill the target's network process; see the module docstring."""
    attackers = [arena.new_peer(f"sybil{i}") for i in range(peers)]
    result = Flood(arena, attackers, [])
    victim = arena.victim.client.transport.identity
    victim_session = f"{victim}/{arena.victim.client.session}"
    tensor = torch.zeros(size // 4)
    for peer in attackers:
        for s in range(sessions):
            session = f"{peer.session}-{s}"
            result.sessions.append((peer, session))
            wait = run([["recv", [0], arena.other]], [2], run_id=WAIT_RUN,
                       peers=peer.identities(arena.other))  # fmt: skip
            peer.send(arena.target, {**wait, "session": session})
            time.sleep(0.05)  # its thread is in the recv: what follows waits in the queue
            for q in range(queued):
                put = {"kind": "put", "session": session, "values": [[10 + q, tensor]]}
                peer.send(arena.target, put)
                result.sent += size
            clients = [f"{peer.transport.identity}/{session}"] * strays + [victim_session]
            for k, client in enumerate(clients):
                transfer = {"kind": "transfer", "client": client, "run": 1000 + k,
                            "src": arena.other, "values": [1], "tensors": [tensor]}  # fmt: skip
                peer.publish(arena.target, wire.encode(transfer))
                result.sent += size
    result.collect()
    return result


def local_worker(arena: Arena) -> Worker:
    """The arena's target worker (local arenas only)."""
    return next(w for w in arena.victim.local_workers if w.name == arena.target)
