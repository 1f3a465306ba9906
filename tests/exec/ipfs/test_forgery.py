"""Forgeries, impostors and bad crypto input from a second peer, each refused while the
client's results stay exact (real Kubo daemons, real worker processes).

The attacker runs on `outsider_node`, a node of the swarm with no worker, as a full endpoint
of its own (it can seal messages for any worker, as any peer of an open grid can). Where an
attack needs what only a broken confidentiality would give (a request id, a session), the
test hands it over, so the authentication is tested on its own. The last tests give the
attacker a worker's name in another worker's directory (`hijacked`), as any peer can take
the name of a worker silent for DEAD_AFTER.
"""

from __future__ import annotations

import os
import queue
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime

import msgpack
import pytest
import torch

import gridgraph as gg
from gridgraph.errors import GridError
from gridgraph.exec import wire
from gridgraph.exec.ipfs import secure
from gridgraph.exec.ipfs.client import grid_over
from gridgraph.exec.ipfs.discovery import HEARTBEAT, discover
from gridgraph.exec.ipfs.kubo import Kubo, KuboError
from gridgraph.exec.ipfs.swarm import NodeInfo, spawn_worker, stop_worker
from gridgraph.exec.ipfs.transport import GridTransport, sealed_blocks, sealed_inline
from gridgraph.exec.protocol import DISCOVERY_TOPIC, client_topic, worker_topic
from gridgraph.exec.safety import droplog
from tests.exec.flood import announcing
from tests.exec.ipfs.fixtures import Inbox, Raw, Tap, WorkerProcess, start_workers, stop_all

pytestmark = pytest.mark.ipfs


def worker(workers: list[WorkerProcess], name: str) -> WorkerProcess:
    return next(w for w in workers if w.name == name)


def wait_for_log(w: WorkerProcess, needle: str, count: int = 1, timeout: float = 15.0) -> str:
    """The worker's log once `needle` appears in it `count` times (fails at `timeout`)."""
    deadline = time.monotonic() + timeout
    while True:
        log = w.log.read_text(errors="replace")
        if log.count(needle) >= count or time.monotonic() > deadline:
            assert log.count(needle) >= count, f"{needle!r} not in {w.name}'s log:\n{log[-3000:]}"
            return log
        time.sleep(0.1)


def fresh_window(w: WorkerProcess, needle: str) -> None:
    """Wait until a warning alike to the last line holding `needle` would be logged again:
    a worker logs at most PER_WARNING alike ones per peer in EVERY s (safety/droplog.py)."""
    lines = [line for line in w.log.read_text(errors="replace").splitlines() if needle in line]
    if lines:
        logged = datetime.strptime(lines[-1][:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        time.sleep(max(0.0, logged + droplog.EVERY + 0.5 - time.time()))


def announce(attacker: Raw, name: str, times: int = 3) -> None:
    """Announce `name` as a worker the attacker runs, as a worker process would."""
    msg = {"kind": "announce", "name": name, "instance": "evil", "lease": 300.0}
    for seq in range(times):
        attacker.transport.publish(DISCOVERY_TOPIC, wire.encode({**msg, "seq": seq}), False)
        time.sleep(0.2)


@pytest.fixture
def attacker(outsider_node: NodeInfo, ipfs_workers) -> Raw:
    raw = Raw(outsider_node.api)
    yield raw
    raw.close()


# --- forgeries ------------------------------------------------------------------------------


def test_a_forged_reply_is_refused(kubo_nodes, ipfs_workers, attacker):
    armed, forged_in = threading.Event(), threading.Event()
    fortytwo = torch.full((8,), 42.0)

    def leak(topic: str, payload: bytes) -> int:
        """The attacker learns every request id (worst case) and answers it first."""
        msg = wire.decode(payload)
        if armed.is_set() and msg["kind"] == "run":
            forged = {"kind": "reply", "re": msg["id"], "worker": "w1", "ok": True,
                      "returns": [[0, fortytwo]], "dynamic": []}  # fmt: skip
            victim = client_topic(tap.identity, msg["session"])  # (no request names it)
            attacker.transport.publish(victim, wire.encode(forged))
        return 1

    held = []

    def hold_genuine(topic: str, payload: bytes) -> bool:
        """Let the forged reply in first: genuine copies are dropped until it came (the
        client resends, the worker answers again)."""
        msg = wire.decode(payload)
        if msg.get("kind") == "reply" and armed.is_set():
            returns = msg.get("returns") or [[0, None]]
            if isinstance(returns[0][1], torch.Tensor) and torch.equal(returns[0][1], fortytwo):
                forged_in.set()
                return True
            if not forged_in.is_set() and len(held) < 20:
                held.append(msg)
                return False
        return True

    tap = Tap(GridTransport(kubo_nodes[0].api, deliver_own=True), leak, hold_genuine)
    with grid_over(tap, workers=["w0", "w1", "w2"], retry_after=0.3) as grid:
        a = torch.randn(8)
        x = a.send(grid.workers[1])
        armed.set()
        got = x.get()
    assert forged_in.is_set()  # the forgery reached the client, which refused it
    assert torch.equal(got, a)


def test_a_forged_transfer_is_refused(ipfs_grid, ipfs_workers, attacker):
    """An attacker announcing a worker of its own sends transfers, for the victim's runs, to
    the worker that waits on a transfer from w1; only w1's is taken."""
    announce(attacker, "w9")
    client = ipfs_grid.client
    assert client.transport.directory.identity("w9", wait=10) == attacker.transport.identity
    _, w1, w2 = ipfs_grid.workers
    a = torch.randn(100)
    x = a.send(w1)
    victim = f"{client.transport.identity}/{client.session}"
    for _ in range(2):  # twice, and paced: PubSub drops what overflows a peer's queue
        for run in range(1, 13):  # any run number the victim's fresh client may use next
            for src in ("w9", "w1"):  # its own name (authentic), and w1's (a lie)
                forged = {"kind": "transfer", "client": victim, "run": run, "values": [x._vid],
                          "src": src, "tensors": [torch.full((100,), 42.0)]}  # fmt: skip
                attacker.publish("w2", wire.encode(forged))
            time.sleep(0.02)
    assert attacker.request("w2", {"kind": "ping"})["ok"]  # after the forgeries, on one topic
    with gg.trace(), gg.on(w2):  # x moves from w1 to w2
        z = x * 2
    assert torch.equal(z.get(), a * 2)
    # Those under the key the run took are dropped as it takes the real one.
    wait_for_log(worker(ipfs_workers, "w2"), "dropped a transfer claiming to come from w1")


def test_a_replayed_request_is_refused(ipfs_grid, ipfs_workers, kubo_nodes, outsider_node):
    """Sealed requests captured on the wire and published again, from the client's own node
    (same peer: the replay window) and from another (another peer: the key does not fit)."""
    w1 = ipfs_grid.workers[1]
    wire_topic = secure.blind_topic(worker_topic("w1"))
    capture = Kubo(outsider_node.api).pubsub_sub(wire_topic)
    captured: queue.Queue[bytes] = queue.Queue()

    def follow() -> None:
        try:
            for message in capture:
                captured.put(message.data)
        except KuboError:
            pass

    threading.Thread(target=follow, daemon=True).start()
    client_node = Kubo(kubo_nodes[0].api)
    while outsider_node.peer_id not in client_node.pubsub_peers(wire_topic):
        time.sleep(0.05)  # until the client's node forwards the topic to the capture
    a = torch.randn(16)
    x = a.send(w1)
    with gg.trace():
        x.add_(1)  # run twice, it would add 2
    gg.compute(x)
    capture.close()
    messages = []
    while not captured.empty():
        messages.append(captured.get())
    assert messages, "the capture saw no request"
    ops = ipfs_grid.stats()["workers"]["w1"]["ops_run"]
    log = worker(ipfs_workers, "w1")
    text = log.log.read_text(errors="replace")
    replays, forgeries = text.count("a replay"), text.count("authentication failed")
    for message in messages:
        client_node.pubsub_pub(wire_topic, message)  # the client's peer
        Kubo(outsider_node.api).pubsub_pub(wire_topic, message)  # another peer
    # (alike warnings from one peer are logged PER_WARNING times in EVERY s: safety/droplog.py)
    wait_for_log(log, "a replay", replays + min(len(messages), droplog.PER_WARNING))
    wait_for_log(log, "authentication failed", forgeries + 1)
    assert ipfs_grid.stats()["workers"]["w1"]["ops_run"] == ops
    assert torch.equal(x.get(), a + 1)


def test_a_reply_goes_only_to_the_requesters_own_topic(ipfs_grid, ipfs_workers, attacker):
    # A request named its reply topic, and the worker checked it: now none names one, and
    # one still naming the victim's topic is answered on the attacker's own.
    victim = ipfs_grid.client
    heard: list[bytes] = []
    victim.transport.subscribe(victim.topic, lambda sender, payload: heard.append(payload))
    reply = attacker.request("w1", {"kind": "ping", "reply_to": victim.topic})
    assert reply["ok"]  # on the attacker's own topic
    time.sleep(0.5)  # (what the victim's topic got meanwhile)
    assert not [p for p in heard if wire.decode(p).get("re") == reply["re"]]
    a = torch.randn(4)
    assert torch.equal(a.send(ipfs_grid.workers[1]).get(), a)


# --- impostors ------------------------------------------------------------------------------


def test_a_worker_not_in_trust_is_ignored(kubo_nodes, ipfs_workers, attacker):
    stop = threading.Event()

    def keep_announcing() -> None:
        while not stop.is_set():
            announce(attacker, "w7", times=1)
            announce(attacker, "w1", times=1)  # and a claim on a trusted worker's name

    announcer = threading.Thread(target=keep_announcing, daemon=True)
    announcer.start()
    try:
        # On an open grid the impostor is a worker like any other...
        assert "w7" in discover(kubo_nodes[0].api, names=["w7"], timeout=10)
        trust = {f"w{n.index}": n.peer_id for n in kubo_nodes}
        # ...with `trust`, it is not one.
        with gg.connect(ipfs=kubo_nodes[0].api, min_workers=3, trust=trust, timeout=30) as grid:
            assert [w.name for w in grid.workers] == ["w0", "w1", "w2"]
            a = torch.randn(5)
            assert torch.equal((a.send(grid.workers[1]) + 1).get(), a + 1)
        peers = [n.peer_id for n in kubo_nodes]
        with pytest.raises(GridError, match="w7"):
            gg.connect(ipfs=kubo_nodes[0].api, workers=["w7"], trust=peers, timeout=3)
    finally:
        stop.set()
        announcer.join()


def test_a_client_not_in_allow_peers_is_not_served(kubo_nodes, outsider_node, tmp_path):
    allowed = tmp_path / "allowed.txt"
    allowed.write_text(f"{kubo_nodes[0].peer_id}\n{kubo_nodes[1].peer_id}\n")
    proc = spawn_worker(kubo_nodes[1].api, "private", tmp_path / "private.log",
                        allow_peers=allowed)  # fmt: skip
    private = WorkerProcess("private", kubo_nodes[1], proc, tmp_path / "private.log")
    try:
        discover(kubo_nodes[0].api, names=["private"], timeout=60, procs=[proc])
        with pytest.raises(GridError, match="did not answer"):
            gg.connect(ipfs=outsider_node.api, workers=["private"], timeout=4)
        wait_for_log(private, "is not among the peers this endpoint serves")
        with gg.connect(ipfs=kubo_nodes[0].api, workers=["private"], timeout=30) as grid:
            a = torch.randn(6)
            assert torch.equal((a.send(grid.workers[0]) * 3).get(), a * 3)
    finally:
        stop_worker(proc)


# --- bad crypto input -----------------------------------------------------------------------


def _tamper(sealed: bytes, how: str) -> bytes:
    version, public, counter, ciphertext = msgpack.unpackb(sealed)
    if how == "truncated ciphertext":
        ciphertext = ciphertext[:8]
    elif how == "tampered tag":
        ciphertext = ciphertext[:-1] + bytes([ciphertext[-1] ^ 1])
    return msgpack.packb([version, public, counter, ciphertext])


@pytest.mark.parametrize(
    "how, logged",
    [
        ("wrong key", "authentication failed"),
        ("truncated ciphertext", "truncated ciphertext"),
        ("tampered tag", "authentication failed"),
        ("replayed nonce", "a replay"),
        ("garbage", "not a sealed message"),
        ("a body of no known kind", "sealed body of unknown kind"),
        ("a block list with a long id", "without a 16-byte id"),  # ids are kept, 1,024
    ],
)
def test_bad_crypto_input_is_dropped_with_a_log_line(ipfs_grid, ipfs_workers, attacker, how,
                                                     logged):  # fmt: skip
    w1 = worker(ipfs_workers, "w1")
    fresh_window(w1, logged)
    before = w1.log.read_text(errors="replace").count(logged)
    topic = worker_topic("w1")
    body = sealed_inline(wire.encode(attacker.envelope({"kind": "ping", "free": []})))
    channel = attacker.transport.channel
    receiver = attacker.transport.recipient(topic)
    if how == "wrong key":  # sealed for another key than w1's
        receiver = secure.make_identity(secure.peer_of(receiver), secure.Channel("x").public)
    if how == "a body of no known kind":  # e.g. the msgpack map sealed before (0x81...)
        body = msgpack.packb({"d": body[1:]})
    if how == "a block list with a long id":
        body = sealed_blocks([("bafkreiexample", 10)], 10, os.urandom(32), b"i" * (64 << 10))
    sealed = channel.seal(receiver, topic, body)
    if how in ("truncated ciphertext", "tampered tag"):
        sealed = _tamper(sealed, how)
    elif how == "garbage":
        sealed = b"\x93\x02garbage"
    kubo = attacker.transport.kubo
    kubo.pubsub_pub(attacker.transport.wire_topic(topic), sealed)
    if how == "replayed nonce":
        assert attacker.replies.get(timeout=15)["ok"]  # the first copy is served
        kubo.pubsub_pub(attacker.transport.wire_topic(topic), sealed)
    wait_for_log(w1, logged, count=before + 1)
    assert w1.proc.poll() is None
    a = torch.randn(3)
    assert torch.equal((a.send(ipfs_grid.workers[1]) - 2).get(), a - 2)


def test_transfers_from_unknown_workers_do_not_stall_a_worker(ipfs_grid, ipfs_workers, attacker):
    """Nothing about a transfer waits on the reader thread (who sent it is checked when a run
    takes it): a burst naming workers nobody has heard of costs nothing, and the worker
    serves on."""
    a = torch.randn(4)
    x = a.send(ipfs_grid.workers[1])
    for i in range(20):
        bogus = {"kind": "transfer", "client": "c/s", "run": 1, "values": [1],
                 "src": f"ghost{i}", "tensors": [torch.zeros(1)]}  # fmt: skip
        attacker.publish("w1", wire.encode(bogus))
    start = time.monotonic()
    assert torch.equal(x.get(), a)
    assert time.monotonic() - start < 20  # 20 lookups waiting 2 s each would take 40 s


# --- a worker name that another worker's directory gives to an impostor ----------------------


@dataclass
class Hijack:
    """w0 and wB, and an impostor that owns the name wB in w0's directory (`hijacked`)."""

    grid: gg.Grid  # a client given `trust`: its directory ignores the impostor
    open_grid: gg.Grid  # a client without `trust`, connected before the impostor came
    attacker: Raw
    heard: Inbox  # what the attacker can open on wB's topic

    def drain(self) -> None:
        while not self.heard.items.empty():
            self.heard.items.get_nowait()


@pytest.fixture(scope="module")
def hijacked(kubo_nodes, ipfs_workers, outsider_node, tmp_path_factory) -> Iterator[Hijack]:
    """Worker `wB` (a process of its own, on node 1) and an impostor that owns its name in
    w0's directory: the attacker on the outsider node announced `wB` while wB was silent
    (stopped) for longer than DEAD_AFTER, and keeps announcing it, so w0 ignores wB's own
    announcements once it answers again. The trusting client knows the real wB; so does the
    open one's directory, as the wB it pinned, though the name is the impostor's there too."""
    [wb] = start_workers([(kubo_nodes[1], "wB")], tmp_path_factory.mktemp("hijacked"))
    attacker = Raw(outsider_node.api)
    heard = Inbox()
    attacker.transport.subscribe(worker_topic("wB"), heard)
    stop = threading.Event()

    def keep_announcing() -> None:
        while not stop.is_set():
            announce(attacker, "wB", times=1)

    announcer = threading.Thread(target=keep_announcing, daemon=True)
    grids: list[gg.Grid] = []
    try:
        grids.append(gg.connect(ipfs=kubo_nodes[0].api, workers=["w0", "wB"], timeout=30))
        directory = attacker.transport.directory  # a directory like w0's, on the attacker
        assert directory.identity("wB", wait=15) is not None
        os.kill(wb.proc.pid, signal.SIGSTOP)
        announcer.start()
        deadline = time.monotonic() + 30
        while directory.identity("wB") != attacker.transport.identity:
            assert time.monotonic() < deadline, "the attacker never took the name wB"
            time.sleep(0.1)
        time.sleep(HEARTBEAT)  # w0's directory heard the same announcements
        os.kill(wb.proc.pid, signal.SIGCONT)
        impostor = f"worker name 'wB', which belongs to live peer {outsider_node.peer_id}"
        wait_for_log(worker(ipfs_workers, "w0"), impostor)  # w0 ignores the real wB now
        trust = {"w0": kubo_nodes[0].peer_id, "wB": kubo_nodes[1].peer_id}
        grids.append(
            gg.connect(ipfs=kubo_nodes[0].api, workers=["w0", "wB"], trust=trust, timeout=30)
        )
        topic = secure.blind_topic(worker_topic("wB"))
        while outsider_node.peer_id not in Kubo(kubo_nodes[0].api).pubsub_peers(topic):
            assert time.monotonic() < deadline + 30, "the attacker's subscription never spread"
            time.sleep(0.1)
        yield Hijack(grids[1], grids[0], attacker, heard)
    finally:
        stop.set()
        stop_all([wb])  # first: a run that still waits on wB ends (WorkerLost)
        for grid in grids:
            grid.close()
        if announcer.is_alive():
            announcer.join()
        attacker.close()


def test_an_impostor_of_a_worker_in_another_workers_view_reads_no_transfer(hijacked):
    """w0 sends x to wB: sealed for the wB the client named, not for the owner of the name in
    w0's directory, and resent on request to that wB only."""
    hijacked.drain()
    w0, wB = hijacked.grid.workers
    a = torch.randn(64)
    x = a.send(w0)
    with gg.trace(), gg.on(wB):
        z = x * 2
    got = {}
    thread = threading.Thread(target=lambda: got.update(z=z.get()), daemon=True)
    thread.start()
    thread.join(60)
    client, attacker = hijacked.grid.client, hijacked.attacker
    victim = f"{client.transport.identity}/{client.session}"
    for run in range(1, 10):  # the impostor asks for it again, as wB would
        resend = {"kind": "resend", "client": victim, "run": run, "value": x._vid, "dst": "wB"}
        attacker.publish("w0", wire.encode(resend))
    assert attacker.request("w0", {"kind": "ping"})["ok"]  # after the resends, on one topic
    assert hijacked.heard.empty_after(2.0), "w0 sealed a message for wB's impostor"
    assert torch.equal(got["z"], a * 2)


def test_an_impostor_of_a_worker_in_another_workers_view_forges_no_transfer(hijacked):
    """The impostor sends w0 transfers "from wB" for the client's next runs: w0 takes only the
    real wB's, the one the client named."""
    w0, wB = hijacked.grid.workers
    a = torch.randn(64)
    x = a.send(wB)
    client = hijacked.grid.client
    victim = f"{client.transport.identity}/{client.session}"
    for run in range(1, 40):
        forged = {"kind": "transfer", "client": victim, "run": run, "values": [x._vid],
                  "src": "wB", "tensors": [torch.full((64,), 42.0)]}  # fmt: skip
        hijacked.attacker.publish("w0", wire.encode(forged))
    assert hijacked.attacker.request("w0", {"kind": "ping"})["ok"]  # after them, on one topic
    with gg.trace(), gg.on(w0):
        z = x + 1
    assert torch.equal(z.get(), a + 1)


def test_an_open_grid_client_seals_nothing_for_an_impostor_of_a_worker_it_pinned(hijacked):
    """The client without `trust` pinned the real wB; the impostor owns the name in its
    directory now. To that client wB is lost, and what it sends wB stays sealed for the wB it
    pinned."""
    hijacked.drain()
    open_wB = hijacked.open_grid.workers[1]
    with pytest.raises(gg.WorkerLost):
        torch.randn(64).send(open_wB)
    assert hijacked.heard.empty_after(2.0), "the client sealed a request for wB's impostor"


def test_a_name_announced_by_a_peer_that_never_answers_is_left_out(
    kubo_nodes, ipfs_workers, outsider_node, caplog
):
    # connect kept every live name it heard and pinged each in turn: one peer announcing a
    # name it never serves made every connect to the open grid fail (a review).
    with announcing(outsider_node.api, "ghost", "x"):
        discover(kubo_nodes[0].api, names=["ghost"], timeout=30)  # heard on the client's node
        with caplog.at_level("WARNING", logger="gridgraph.ipfs"):
            for _ in range(3):  # (until a connect has heard it before it chose its workers)
                with gg.connect(ipfs=kubo_nodes[0].api, min_workers=3, timeout=60) as grid:
                    assert "ghost" not in [w.name for w in grid.workers]
                    a = torch.randn(4)
                    assert torch.equal((a.send(grid.workers[0]) + 1).get(), a + 1)
                if "did not answer: ghost" in caplog.text:
                    break
        assert "did not answer: ghost" in caplog.text  # it was heard, then left out
        with pytest.raises(GridError, match="ghost"):  # named, it must answer
            gg.connect(ipfs=kubo_nodes[0].api, workers=["ghost"], timeout=5)


def test_a_workers_lease_sets_how_often_that_worker_alone_is_pinged(kubo_nodes, tmp_path):
    # The keep-alive pinged every worker at a third of the shortest lease any of them
    # announced: a worker announcing 1 ms made its clients flood every worker they used.
    workers = start_workers(
        [(kubo_nodes[1], "hasty")], tmp_path / "hasty", lease=0.001
    ) + start_workers([(kubo_nodes[2], "calm")], tmp_path / "calm")
    pings: dict[str, int] = {"hasty": 0, "calm": 0}

    def count(topic: str, payload: bytes) -> int:
        for name in pings:
            if topic == worker_topic(name):
                pings[name] += 1
        return 1

    try:
        tap = Tap(GridTransport(kubo_nodes[0].api), count)
        with grid_over(tap, workers=["hasty", "calm"], timeout=30):
            before = dict(pings)
            time.sleep(3)
            during = {name: pings[name] - before[name] for name in pings}
        assert during["calm"] == 0  # its lease is 300 s: pinged every 100 s
        assert during["hasty"] <= 3 / 0.5 + 1  # at most every MIN_PING_INTERVAL
    finally:
        stop_all(workers)
