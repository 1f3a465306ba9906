"""The arena of the adversarial suite and the fuzzer: a worker, a victim, an attacker.

`arena` (a fixture, on each transport) is a worker `target` that serves a well-behaved client
(`victim`, a `gg.Grid` holding a tensor on it) and an attacker (`attacker`, a `hostile.Peer`
with an endpoint of its own: on the local bus, or a Kubo node of its own on IPFS).
`arena.check()` asserts what every attack must leave true: the victim's tensor is unchanged,
the victim's computations are exact (compared with plain torch), the worker still serves.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch

import gridgraph as gg
from gridgraph.exec.safety.limits import Limits
from tests.exec.hostile import Peer, run

MiB = 1 << 20
LOCAL_LIMITS = dict(
    max_client_memory=256 * MiB, max_request_seconds=5.0, max_message_bytes=16 * MiB
)


@dataclass
class Arena:
    """A worker (`target`) that serves a well-behaved client and an attacker."""

    kind: str  # "local" or "ipfs"
    victim: gg.Grid
    attacker: Peer
    target: str
    other: str  # a second worker the victim uses
    alive: Callable[[], bool]
    new_peer: Callable[[str], Peer]  # another hand-made client, with an endpoint of its own

    def __post_init__(self) -> None:
        w = {ref.name: ref for ref in self.victim.workers}
        gen = torch.Generator().manual_seed(0)
        # Small integers: every product and sum is exact, on any machine, in any order.
        self.data = torch.randint(-8, 8, (16, 8), generator=gen).float()
        self.weights = torch.randint(-8, 8, (8, 4), generator=gen).float()
        self.x = self.data.send(w[self.target])
        self.W = self.weights.send(w[self.other])

    def check(self) -> None:
        """The victim's tensors are unchanged, it computes exact results, the worker lives."""
        assert torch.equal(self.x.get(), self.data)
        with gg.trace():
            y = torch.relu(self.x @ self.W).sum(0) - self.x.sum()
        assert torch.equal(y.get(), torch.relu(self.data @ self.weights).sum(0) - self.data.sum())
        assert self.alive()

    def attack(self, msg: dict, timeout: float = 20.0) -> dict:
        """Send `msg` from the attacker to the target and return the reply."""
        return self.attacker.request(self.target, msg, timeout=timeout)

    def refused(self, msg: dict, *words: str) -> dict:
        """The attack is answered with an error naming `words`, and harms no one."""
        reply = self.attack(msg)
        assert reply["ok"] is False, reply
        text = str(reply["error"]).lower()
        assert all(w.lower() in text for w in words), reply["error"]
        self.check()
        return reply

    def attacker_put(self, vid: int, tensor: torch.Tensor) -> None:
        assert self.attack({"kind": "put", "values": [[vid, tensor]]})["ok"]

    def attacker_get(self, vid: int) -> dict:
        return self.attack(run([["return", 0]], [vid], plan=vid + 10_000))


# --- the two arenas -------------------------------------------------------------------------


def local_arena(**limits: object) -> Iterator[Arena]:
    """An in-process grid of two workers with LOCAL_LIMITS (and `limits` over them)."""
    limits = {"limits": Limits(**{**LOCAL_LIMITS, **limits})}
    with gg.local_grid(2, **limits) as grid:
        bus = grid.client.transport._bus
        peers: list[Peer] = []

        def new_peer(name: str) -> Peer:
            peers.append(Peer(bus.endpoint(f"{name}-{uuid.uuid4().hex[:6]}")))
            return peers[-1]

        yield Arena("local", grid, new_peer("mallory"), "w1", "w0", lambda: True, new_peer)
        for p in peers:
            p.close()


def ipfs_arena(request: pytest.FixtureRequest) -> Iterator[Arena]:
    """The Kubo workers w0, w1, w2 (worker processes with the default limits); the victim is
    `ipfs_grid`'s client on node 0, the attacker on a Kubo node of its own; other hand-made
    clients (`new_peer`) on node 0, beside the victim."""
    from gridgraph.exec.protocol import worker_topic
    from tests.exec.ipfs.fixtures import sealed_endpoint

    attacker = request.getfixturevalue("outsider_node")  # no worker, in no trust list
    nodes = request.getfixturevalue("kubo_nodes")
    workers = request.getfixturevalue("ipfs_workers")
    grid = request.getfixturevalue("ipfs_grid")
    peers: list[Peer] = []

    def peer_on(api: str, session: str) -> Peer:
        transport = sealed_endpoint(api)
        transport.wait_for_peers(worker_topic("w1"), 1, timeout=30)
        # Workers outlive the test: a fresh session, so no test sees another's state.
        peers.append(Peer(transport, session=f"{session}-{uuid.uuid4().hex[:8]}", resend=1.0))
        return peers[-1]

    def alive() -> bool:
        return all(w.proc.poll() is None for w in workers)

    mallory = peer_on(attacker.api, "mallory")
    yield Arena("ipfs", grid, mallory, "w1", "w0", alive, lambda name: peer_on(nodes[0].api, name))
    for p in peers:
        p.close()


@pytest.fixture(name="arena", params=["local", pytest.param("ipfs", marks=pytest.mark.ipfs)])
def arena_fixture(request) -> Iterator[Arena]:
    if request.param == "local":
        yield from local_arena()
    else:
        yield from ipfs_arena(request)
