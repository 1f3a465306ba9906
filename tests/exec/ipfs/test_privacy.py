"""A spy on the swarm reads none of a client's tensors, and close() leaves no block behind.

The spy runs on a fourth node (`outsider_node`). It follows the discovery topic and every
topic it can name: each worker's topic (in the clear and as the transport blinds it), the
client's reply topic and every endpoint's ack topic (which a peer could learn from the
swarm's subscription gossip). It fetches every CID that appears in any message, and after
`close()` reads every block of every repo. Every tensor the client sends, gets or has moved
between workers is filled with a marker value; the spy must find none of them.
"""

from __future__ import annotations

import re
import struct
import threading
import time

import pytest
import torch

import gridgraph as gg
from gridgraph.exec.ipfs import secure
from gridgraph.exec.ipfs.discovery import load_trust
from gridgraph.exec.ipfs.kubo import Kubo, KuboError
from gridgraph.exec.ipfs.transport import ACK_PREFIX, INLINE_MAX, IpfsTransport
from gridgraph.exec.protocol import DISCOVERY_TOPIC, worker_topic

pytestmark = pytest.mark.ipfs

CID = re.compile(rb"baf[a-z2-7]{50,60}")
MARKERS = {  # float32 values whose bytes occur nowhere by chance
    "small put": 1234.5677490234375,
    "large put": -987.6542358398438,
    "small transfer": 31415.927734375,
    "large transfer": -27182.818359375,
}


def needle(value: float) -> bytes:
    return struct.pack("<f", value) * 4  # 16 bytes of the marker


class Spy:
    """Raw subscriptions on `topics` through one node; scans what it sees for markers."""

    def __init__(self, api: str, topics: list[str]) -> None:
        self.kubo = Kubo(api)
        self.messages = self.bytes = 0
        self.cids: set[str] = set()
        self.hits: list[str] = []
        self.lock = threading.Lock()
        self.streams = [self.kubo.pubsub_sub(topic) for topic in topics]
        for stream in self.streams:
            threading.Thread(target=self._follow, args=(stream,), daemon=True).start()

    def _follow(self, stream) -> None:
        try:
            for message in stream:
                with self.lock:
                    self.messages += 1
                    self.bytes += len(message.data)
                    self.cids.update(c.decode() for c in CID.findall(message.data))
                self.scan(message.data, f"message on {stream.topic}")
        except KuboError:
            pass  # closed

    def scan(self, data: bytes, where: str) -> None:
        for name, value in MARKERS.items():
            if needle(value) in data:
                with self.lock:
                    self.hits.append(f"{name} in {where}")

    def fetch_named_blocks(self) -> int:
        """Fetch every CID seen in a message; returns how many could be fetched."""
        got = 0
        for cid in sorted(self.cids):
            try:
                self.scan(self.kubo.block_get(cid, timeout=2), f"block {cid}")
                got += 1
            except KuboError:
                pass  # removed everywhere already
        return got

    def close(self) -> None:
        for stream in self.streams:
            stream.close()


def read_repos(apis: list[str], spy: Spy) -> tuple[int, int]:
    """Read every block of every repo; returns (blocks, bytes) read."""
    blocks = nbytes = 0
    for api in apis:
        kubo = Kubo(api)
        for cid in kubo.refs_local():
            data = kubo.block_get(cid, timeout=5)
            blocks += 1
            nbytes += len(data)
            spy.scan(data, f"repo {api} block {cid}")
    return blocks, nbytes


def test_a_spy_reads_none_of_a_clients_tensors(kubo_nodes, ipfs_workers, outsider_node):
    apis = [n.api for n in kubo_nodes] + [outsider_node.api]
    before = {api: set(Kubo(api).refs_local()) for api in apis}
    trust = {f"w{n.index}": n.peer_id for n in kubo_nodes}
    grid = gg.connect(ipfs=kubo_nodes[0].api, workers=list(trust), trust=trust, timeout=30)
    client = grid.client
    directory = client.transport.directory
    endpoints = [client.transport.identity] + [directory.identity(w) for w in trust]
    names = [DISCOVERY_TOPIC, "spy.control"]
    for w in trust:
        names += [worker_topic(w), secure.blind_topic(worker_topic(w))]
    names += [secure.blind_topic(client.topic)]
    names += [secure.blind_topic(ACK_PREFIX + e) for e in endpoints]
    spy = Spy(outsider_node.api, names)
    try:
        # The spy works: a marker sent in the clear is found, in a message and in a repo.
        control = IpfsTransport(kubo_nodes[1].api)
        control.wait_for_peers("spy.control", 1)
        control.publish("spy.control", needle(MARKERS["small put"]) * 4)
        cid = Kubo(kubo_nodes[1].api).block_put(needle(MARKERS["large put"]))
        deadline = time.monotonic() + 10
        while not spy.hits and time.monotonic() < deadline:
            time.sleep(0.05)
        read_repos([kubo_nodes[1].api], spy)
        assert len(spy.hits) == 2, spy.hits
        Kubo(kubo_nodes[1].api).block_rm([cid])
        control.close()
        spy.hits.clear()

        w0, w1, w2 = grid.workers
        n_large = 2 * INLINE_MAX  # floats: 2 MB, over the block threshold
        small = torch.full((64,), MARKERS["small put"])
        large = torch.full((n_large,), MARKERS["large put"])
        xs = torch.full((1000,), MARKERS["small transfer"]).send(w1)
        xl = torch.full((n_large,), MARKERS["large transfer"]).send(w1)
        ps, pl = small.send(w2), large.send(w0)
        with gg.trace(), gg.on(w2):  # xs and xl move from w1 to w2
            zs, zl = xs * 2, xl * 2
        assert torch.equal(ps.get(), small) and torch.equal(pl.get(), large)
        assert torch.equal(zs.get(), torch.full((1000,), 2 * MARKERS["small transfer"]))
        assert torch.equal(zl.get(), torch.full((n_large,), 2 * MARKERS["large transfer"]))
        assert torch.equal(xl.get(), torch.full((n_large,), MARKERS["large transfer"]))
        assert grid.client.last_plan is not None
    finally:
        grid.close()
    named = spy.fetch_named_blocks()
    # Blocks go as soon as their receiver has them (and acknowledged them to the sender).
    deadline = time.monotonic() + 15
    while True:
        left = {api: set(Kubo(api).refs_local()) - before[api] for api in apis}
        if not any(left.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    blocks, nbytes = read_repos(apis, spy)
    spy.close()
    print(
        f"\nspy: {spy.messages} messages ({spy.bytes} bytes) on {len(names)} topics; "
        f"{len(spy.cids)} CIDs named in them, {named} fetched; {blocks} blocks "
        f"({nbytes} bytes) read from {len(apis)} repos after close(); "
        f"{sum(len(v) for v in left.values())} blocks left from the session; "
        f"marker hits: {len(spy.hits)}"
    )
    assert spy.messages > 0  # it did see the traffic
    assert spy.hits == []
    assert spy.cids == set() and named == 0
    assert not any(left.values()), {api: len(v) for api, v in left.items()}
    pins = Kubo(kubo_nodes[0].api)._call("/pin/ls", opts={"type": "all"})[0].get("Keys") or {}
    assert not (set(pins) & set().union(*left.values()))


def test_load_trust_reads_maps_lists_and_files(tmp_path):
    pairs = tmp_path / "trust.txt"
    pairs.write_text("# grid\nw0 12D3KooWA\nw1 12D3KooWB  # second\n")
    assert load_trust(pairs) == {"w0": "12D3KooWA", "w1": "12D3KooWB"}
    peers = tmp_path / "peers.txt"
    peers.write_text("12D3KooWA\n12D3KooWB\n")
    assert load_trust(peers) == {"12D3KooWA", "12D3KooWB"}
    as_json = tmp_path / "trust.json"
    as_json.write_text('{"w0": "12D3KooWA"}')
    assert load_trust(as_json) == {"w0": "12D3KooWA"}
    with pytest.raises(ValueError, match="bad worker name"):
        load_trust({"no spaces": "12D3KooWA"})
