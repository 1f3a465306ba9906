"""Executor processes: each session's programs run apart, and a lost one ends only its session.

`gg.local_grid(n, isolate=True)` runs its workers' executors as processes, as `gridgraph
worker` does on IPFS; every value is compared with plain torch.
"""

from __future__ import annotations

import errno
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import time
import tracemalloc

import msgpack
import pytest
import torch

import gridgraph as gg
from gridgraph.exec import wire
from gridgraph.exec.isolation import executor
from gridgraph.exec.protocol import MAX_NAME
from gridgraph.exec.safety.limits import Limits
from gridgraph.exec.worker.session import Session
from tests.exec.local_peer import Peer, add_one_in_place, second_client


@pytest.fixture(scope="module")
def isolated():
    """Two isolating workers, shared by the tests of this file (the forkserver starts once)."""
    with gg.local_grid(2, isolate=True) as grid:
        yield grid


def executor_pid(grid: gg.Grid, worker: int, client: gg.Grid) -> int:
    key = f"{client.client.transport.identity}/{client.client.session}"
    return grid.local_workers[worker].sessions[key].executor.process.pid


def test_programs_run_in_a_process_of_their_own_with_the_same_results(isolated):
    w0, w1 = isolated.workers
    a, b = torch.randn(30, 20), torch.randn(20, 10)
    x, y = a.send(w0), b.send(w1)
    with gg.trace():
        z = torch.relu(x @ y).sum(0)
    assert torch.allclose(z.get(), torch.relu(a @ b).sum(0))
    pids = {executor_pid(isolated, i, isolated) for i in (0, 1)}
    assert os.getpid() not in pids and len(pids) == 2
    stats = isolated.stats()["workers"]
    assert stats["w0"]["objects"] >= 1 and stats["w0"]["ops_run"] >= 1


def test_a_large_tensor_goes_through_shared_memory_exactly(isolated):
    a = torch.randn(3_000_000)  # 12 MB: over the inline size, so a shared file carries it
    x = a.send(isolated.workers[1])
    assert torch.equal((x * 2).get(), a * 2)
    with gg.trace(), gg.on(isolated.workers[0]):  # a transfer from w1's executor to w0's
        y = x + 1
    assert torch.equal(y.get(), a + 1)


def test_exactly_once_holds_in_an_executor(isolated):
    peer = Peer(isolated, "replayer")
    assert peer.request("w0", {"kind": "put", "values": [[1, torch.zeros(3)]]})["ok"]
    rid = "fixed-id"
    assert peer.request("w0", add_one_in_place(1), rid)["ok"]
    for _ in range(300):
        assert Peer(isolated, "noise").request("w0", {"kind": "ping"})["ok"]
    assert peer.request("w0", add_one_in_place(1), rid)["ok"]
    fetch = {"kind": "run", "run": 2, "plan": 2, "program": [[["return", 0]]], "slots": [2],
             "params": []}  # fmt: skip
    assert torch.equal(peer.request("w0", fetch)["returns"][0][1], torch.ones(3))


def test_a_crashed_executor_ends_only_its_session(isolated):
    other = second_client(isolated, "victim-of-crash")
    a, b = torch.randn(8), torch.randn(8)
    mine, theirs = a.send(isolated.workers[0]), b.send(other.workers[0])
    elsewhere = b.send(other.workers[1])
    os.kill(executor_pid(isolated, 0, other), signal.SIGKILL)  # as a kernel crash would
    with pytest.raises(gg.SessionLost, match="killed") as lost:
        (theirs + 1).get()
    assert lost.value.worker == "w0"
    with pytest.raises(gg.SessionLost):  # and it stays lost, saying why
        (theirs * 2).get()
    assert torch.equal((elsewhere + 1).get(), b + 1)  # its session on w1 carries on
    assert torch.equal((mine + 1).get(), a + 1)  # and so does every other client
    other.close()


def test_a_single_op_past_the_time_limit_is_killed_and_ends_only_its_session():
    with gg.local_grid(1, limits=Limits(max_request_seconds=1), isolate=True) as grid:
        other = second_client(grid, "patient")
        a = torch.randn(4)
        ok = a.send(other.workers[0])
        m = torch.randn(2500, 2500, dtype=torch.float64).send(grid.workers[0])
        start = time.monotonic()
        with pytest.raises(gg.SessionLost, match=r"time limit of 1 s"):
            torch.linalg.eig(m)[0].get()  # one op of many seconds: only a kill stops it
        assert time.monotonic() - start < 30
        assert torch.equal((ok * 3).get(), a * 3)
        other.close()


def test_a_lost_executor_closed_again_closes_nothing_of_anyone_elses():
    # A lost executor was closed when lost and again when its session ended, and the second
    # close closed its descriptor numbers again: by then another session's executor had
    # them, and that session was lost (a review: four crashes, a victim's start, four byes).
    with gg.local_grid(1, isolate=True) as grid:
        a = torch.randn(4)
        mallory = [second_client(grid, "mallory") for _ in range(4)]
        for client in mallory:
            x = a.send(client.workers[0])
            os.kill(executor_pid(grid, 0, client), signal.SIGKILL)
            with pytest.raises(gg.SessionLost):
                (x + 1).get()
        victim = second_client(grid, "victim")
        big = torch.randn(1 << 18)  # 1 MiB: through the shared files
        theirs = big.send(victim.workers[0])
        for client in mallory:
            client.close()  # its bye closes its lost executor again
        assert torch.equal((theirs * 2).get(), big * 2)
        victim.close()


class _Taken:
    """The process of an executor that a kernel bug handed to its client's program: it
    sends whatever frames it likes (here, the test's)."""

    exitcode = None

    def is_alive(self) -> bool:
        return False

    def join(self, timeout: float | None = None) -> None:
        pass

    def kill(self) -> None:
        pass


def _taken_over() -> tuple[executor.Executor, multiprocessing.connection.Connection]:
    """The network process's handle on a taken-over executor, and the executor's end of
    their pipe, from which the test sends what it likes."""
    handle = executor.Executor.__new__(executor.Executor)
    network, taken = multiprocessing.Pipe(duplex=True)
    handle.channel = executor._Channel(network, out=os.memfd_create("d"), into=os.memfd_create("u"))
    handle.process, handle.lost, handle.places, handle.cgroups = _Taken(), None, None, []
    handle.max_data = {"transfer": 1 << 20, "reply": 1 << 20}
    handle.told_upto = 0
    return handle, taken


def _forged(**fields: object) -> bytes:
    """A transfer of session mallory/s's run 1 from w0, value 0, with `fields` changed."""
    msg = {"kind": "transfer", "client": "mallory/s", "run": 1, "src": "w0", "values": [0],
           "tensors": [torch.ones(2)], **fields}  # fmt: skip
    return wire.encode(msg)


@pytest.mark.parametrize(
    "frame",
    [
        ["reply", -(2**62), b"x"],  # it would hold less than nothing: any inbox fitted
        ["recv", 1, 1, "w1", "w1", float("nan"), 0.1],  # its wait spun on the lock for ever
        ["recv", 1, 1, "w1", "w1", float("inf"), 0.1],
        ["recv", 1, 1, "w1", "w1", 1.0, float("nan")],  # when to ask again: as a wait
        ["recv", 1, 1, "w1", "w1", 1.0],  # the frame of before asks were learned
        ["recv", 1, 1, "w1", 5, 1.0, 0.1],
        ["transfer", "w1", "w1", -1, 0, b"x"],
        ["transfer", "w" * (MAX_NAME + 1), "w1", 1, 0, _forged()],  # each kept, uncounted
        ["transfer", "w1", "i" * (MAX_NAME + 1), 1, 0, _forged()],
        ["recv", 1, 1, "w1", "i" * (MAX_NAME + 1), 1.0, 0.1],
        ["transfer", "w1", "w1", 1, 0],  # no data
        ["transfer", "w1", "w1", 1, 0, 1 << 20],  # shared data announced, none written
        ["transfer", "w1", "w1", 1, 0, 1 << 30],  # over a message: read, kept, 1 GiB each
        ["transfer", "w1", "w1", 1, 0, _forged(client="victim/s")],  # into another's run
        ["transfer", "w1", "w1", 1, 0, _forged(src="w2")],  # as another worker
        ["transfer", "w1", "w1", 1, 0, _forged(run=2)],  # under another key than it names
    ],
    ids=[
        "negative-held",
        "nan-wait",
        "endless-wait",
        "nan-ask",
        "short-frame",
        "unnamed-peer",
        "negative-run",
        "long-worker-name",
        "long-identity",
        "recv-long-identity",
        "no-data",
        "no-shared-data",
        "over-a-message",
        "another-clients-run",
        "another-worker",
        "another-key",
    ],
)
def test_every_frame_from_a_taken_over_executor_is_checked(frame):
    with gg.local_grid(1, limits=Limits(max_client_memory=1 << 20)) as grid:
        session = Session("mallory/s", "mallory")
        handle, taken = _taken_over()
        for sent in frame if isinstance(frame[0], list) else [frame]:
            taken.send_bytes(sent if isinstance(sent, bytes) else msgpack.packb(sent))
        outcome = []

        def serve() -> None:
            try:
                handle.request(b"", 0, grid.local_workers[0], session)
            except executor.ExecutorLost as e:
                outcome.append(str(e))

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        thread.join(20)
        assert not thread.is_alive() and outcome, "the network process is still serving it"
        assert session.elsewhere == 0 and session.memory() >= 0


def test_a_cancel_is_told_the_executor_while_its_request_runs():
    # The abort reached only the network process's copy of the session; the executor's
    # program ran on to its end.
    with gg.local_grid(1) as grid:
        session = Session("mallory/s", "mallory")
        handle, taken = _taken_over()
        thread = threading.Thread(
            target=handle.request, args=(b"r", 0, grid.local_workers[0], session), daemon=True
        )
        thread.start()
        assert msgpack.unpackb(taken.recv_bytes()) == ["request", 0, b"r"]
        session.abort(None, upto=7)  # (the transport's thread, at the client's cancel)
        assert taken.poll(5) and msgpack.unpackb(taken.recv_bytes()) == ["abort", 7]
        session.abort(None, upto=3)  # (lower: nothing more to say)
        assert not taken.poll(0.3)
        taken.send_bytes(msgpack.packb(["reply", 0, b"done"]))
        thread.join(5)
        assert not thread.is_alive() and handle.told_upto == 7


def test_data_from_an_executor_is_read_only_up_to_what_its_kind_of_frame_may_hold():
    # A transfer announcing 1 GiB was read into the network process (and kept) whatever the
    # limits: the bound was at least 1 GiB for every frame.
    limits = Limits(max_client_memory=8 << 20, max_message_bytes=1 << 20)
    network, taken = multiprocessing.Pipe(duplex=True)
    up = os.memfd_create("up")
    os.ftruncate(up, 1 << 30)  # (sparse: free for the sender)
    taken.send_bytes(msgpack.packb(["transfer", "w1", "w1", 1, 0, 1 << 30]))
    channel = executor._Channel(network, out=os.memfd_create("down"), into=up)
    with pytest.raises(ValueError, match="data of"):
        channel.receive(executor.data_limits(limits))
    channel.close()
    assert executor.data_limits(limits) == {"transfer": 1 << 20, "reply": (8 << 20) + (1 << 20)}


def test_executors_are_capped_worker_wide_and_a_session_past_the_cap_is_refused():
    # Sessions cost nothing to open (any new identity gets 64), and each executor holds some
    # 15 MB of its own: a thousand of them took the machine's memory and its process table.
    with gg.local_grid(1, limits=Limits(max_executors=2), isolate=True) as grid:
        a = torch.randn(4)
        first = a.send(grid.workers[0])
        other = second_client(grid, "second")
        second = a.send(other.workers[0])
        third = second_client(grid, "third")
        assert "w0" in third.stats()["workers"]  # (stats need no executor)
        with pytest.raises(gg.RemoteError, match="max_executors"):
            a.send(third.workers[0])
        assert torch.equal((first + 1).get(), a + 1)
        assert torch.equal((second * 2).get(), a * 2)
        other.close()  # its bye ends its executor, and frees its place
        late = a.send(third.workers[0])
        assert torch.equal((late - 1).get(), a - 1)
        third.close()


def test_one_peer_cannot_take_every_executor_place():
    # Sessions cost nothing to open: one peer that opened as many as a worker has executor
    # places held them all, and every other client's first request was refused.
    with gg.local_grid(1, limits=Limits(max_executors=32), isolate=True) as grid:
        a = torch.randn(4)
        hoard = [second_client(grid, "mallory") for _ in range(32)]
        for client in hoard:
            try:
                a.send(client.workers[0])
            except gg.RemoteError as e:  # (once the places are gone, on the old defaults)
                assert "max_executors" in str(e)
        bob = second_client(grid, "bob")
        assert torch.equal((a.send(bob.workers[0]) + 1).get(), a + 1)
        held = sum(s.executor is not None for s in grid.local_workers[0].sessions.values())
        assert held <= Limits().sessions_per_peer + 2  # mallory's share, bob's and ours
        for client in [*hoard, bob]:
            client.close()


def test_waiting_for_a_frame_on_a_closed_channel_fails_at_once():
    # The poll object made once per channel keeps the pipe's descriptor number: once closed
    # (its session ended under a serving thread), that number may be another executor's
    # pipe or a socket by now, and a wait on it lasted up to the time limit.
    handle, _ = _taken_over()
    handle.channel.close()
    start = time.monotonic()
    with pytest.raises(OSError, match="closed"):
        handle.channel.readable(60)
    assert time.monotonic() - start < 1


def _channels() -> tuple[executor._Channel, executor._Channel]:
    """Both ends of a channel, as the network process and an executor hold them."""
    network, taken = multiprocessing.Pipe(duplex=True)
    down, up = os.memfd_create("down"), os.memfd_create("up")
    return (
        executor._Channel(network, out=down, into=up),
        executor._Channel(taken, out=os.dup(up), into=os.dup(down)),
    )


def test_frames_arrive_whole_and_in_order_however_the_pipe_cuts_them():
    # A frame is read with one read where the pipe has it whole; frames written together
    # are read together and kept for the next receive, and one written a byte at a time,
    # or larger than a read, is put together.
    near, far = _channels()
    frames = [["request", 1, b"a" * 10], ["recv-error", "timeout", "late"],
              ["request", 2, b"b" * executor.INLINE_MAX]]  # fmt: skip
    packed = [msgpack.packb(f) for f in frames]
    os.write(far._fd, b"".join(len(p).to_bytes(4, "big") + p for p in packed[:2]))
    slow = threading.Thread(
        target=lambda: (
            [os.write(far._fd, bytes([b])) for b in len(packed[2]).to_bytes(4, "big")]
            + [os.write(far._fd, packed[2][i : i + 1000]) for i in range(0, len(packed[2]), 1000)]
        )
    )
    slow.start()
    assert near.receive({}) == (["request", 1], bytearray(b"a" * 10))
    assert near.readable(0)  # (the second frame was read with the first)
    assert near.receive({}) == (["recv-error", "timeout", "late"], None)
    assert near.receive({}) == (["request", 2], bytearray(b"b" * executor.INLINE_MAX))
    slow.join()
    far.send(["reply", 3], b"c" * (executor.INLINE_MAX + 1))  # through the shared file
    assert near.receive({}) == (["reply", 3], bytearray(b"c" * (executor.INLINE_MAX + 1)))


@pytest.mark.parametrize(
    "sent, error",
    [
        ((5).to_bytes(4, "big") + b"\x93", EOFError),  # the pipe ends within a frame
        ((0).to_bytes(4, "big"), ValueError),
        ((executor.FRAME_MAX + 1).to_bytes(4, "big"), ValueError),  # read no further
        ((2**32 - 1).to_bytes(4, "big"), ValueError),
        ((3).to_bytes(4, "big") + b"\xc1\xc1\xc1", ValueError),
    ],
    ids=["cut-short", "empty", "over-frame-max", "largest-length", "not-msgpack"],
)
def test_a_frame_that_is_not_one_is_refused(sent, error):
    near, far = _channels()
    os.write(far._fd, sent)
    if error is EOFError:
        far.close()
    with pytest.raises(error):
        near.receive({})


def test_a_closed_channel_reads_and_writes_nothing_that_has_its_numbers_now():
    # Closed under a serving thread (its session ended), the channel kept its descriptor
    # numbers: the thread's next frame went into whatever pipe had the number by then
    # (another session's executor's), and a read took that pipe's frames.
    near, far = _channels()
    number = near._fd
    reader, writer = os.pipe()
    os.set_blocking(reader, False)
    near.close()
    os.dup2(writer, number)  # another pipe has the number now
    with pytest.raises(OSError):
        near.send(["recv-error", "timeout", "late"])
    with pytest.raises(BlockingIOError):
        os.read(reader, 100)  # nothing went into it
    os.dup2(reader, number)
    os.write(writer, b"another session's frame")
    with pytest.raises(OSError):
        near.receive({})
    assert os.read(reader, 100) == b"another session's frame"  # still there
    for fd in (number, reader, writer):
        os.close(fd)
    far.close()


def _flooding(frame: bytes):
    """The frames from a taken-over executor that always has another valid transfer of its
    own run waiting (for 30 s, then its pipe ends)."""
    until = time.monotonic() + 30

    def next_frame() -> bytes:
        if time.monotonic() > until:
            raise EOFError
        return frame

    return next_frame


def test_an_executor_sending_frames_without_pause_is_still_stopped_at_the_time_limit():
    # The limit was checked only when no frame was waiting: an executor that kept sending
    # valid transfers of its own run was served, and had each published, for as long as it
    # kept sending (a review sent 191,779 in 20 s under a 1 s limit).
    with gg.local_grid(1, limits=Limits(max_request_seconds=1)) as grid:
        handle, _ = _taken_over()
        handle.channel._frame = _flooding(msgpack.packb(["transfer", "w1", "w1", 1, 0, _forged()]))
        handle.channel.readable = lambda seconds: True  # (a frame always waits)
        start = time.monotonic()
        with pytest.raises(executor.ExecutorLost, match="time limit of 1 s"):
            handle.request(b"", 0, grid.local_workers[0], Session("mallory/s", "mallory"))
        assert time.monotonic() - start < 1 + executor.KILL_GRACE + 20  # not the flood's 30 s


class _NoDescriptors:
    """The executors' multiprocessing context on a worker out of file descriptors."""

    def Pipe(self, duplex: bool = True):  # noqa: N802 (multiprocessing's name)
        raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))


def test_an_executor_that_cannot_start_gets_an_error_reply_and_frees_its_place(monkeypatch):
    # Its place was taken before the pipe was made, and never given back: after one fd
    # shortage, a worker refused every new session for good; the request got no reply.
    with gg.local_grid(1, limits=Limits(max_executors=1), isolate=True) as grid:
        a = torch.randn(4)
        monkeypatch.setattr(executor, "_context", _NoDescriptors)
        with pytest.raises(gg.RemoteError, match="could not start a process"):
            a.send(grid.workers[0])
        monkeypatch.undo()
        x = a.send(grid.workers[0])  # its place is free again
        assert torch.equal((x + 1).get(), a + 1)


class _Dying(_Taken):
    """A taken-over executor's process, whose end of the pipe closes when it is killed."""

    def __init__(self, end: multiprocessing.connection.Connection) -> None:
        self.end = end

    def kill(self) -> None:
        self.end.close()


def test_an_executor_that_sends_part_of_a_frame_is_killed_at_the_time_limit():
    # The time was checked between frames only: 4 bytes of a frame's header blocked the read
    # of the rest for ever, and held the session and its executor's place with it.
    with gg.local_grid(1, limits=Limits(max_request_seconds=1)) as grid:
        handle, taken = _taken_over()
        handle.process = _Dying(taken)
        os.write(taken.fileno(), (100).to_bytes(4, "big"))  # a 100-byte frame's header, only
        outcome = []

        def serve() -> None:
            try:
                handle.request(b"", 0, grid.local_workers[0], Session("mallory/s", "mallory"))
            except executor.ExecutorLost as e:
                outcome.append(str(e))

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        thread.join(1 + executor.KILL_GRACE + 20)
        assert not thread.is_alive(), "the network process still waits for the frame's rest"
        assert outcome and "time limit of 1 s" in outcome[0]


# --- frames whose decoding would cost the network process -----------------------------------


def _costly_frame(shape: str) -> bytes:
    """A frame that a taken-over executor sends in place of its reply, its msgpack holding
    an array or map per byte or two, each an allocation to decode: `wide`, within the size
    frames had before they were capped; the others within FRAME_MAX: `long`, one long array;
    `tree`, `deep` and `maps`, arrays of at most 7 items (1-100 deep; empty maps)."""

    def tree(leaf: object, depth: int) -> object:  # (7**depth leaves)
        return leaf if depth == 0 else [tree(leaf, depth - 1)] * 7

    chain: list = []
    for _ in range(99):
        chain = [chain]
    n = executor.FRAME_MAX // 2 - 64
    frame = {
        "wide": ["reply", 0, [[]] * ((1 << 20) - 64)],
        "long": ["reply", 0, [[]] * n],
        "tree": ["reply", 0, tree([], 5), tree([], 5)],
        "deep": ["reply", 0, tree(chain, 3), tree(chain, 3)],
        "maps": ["recv", 1, 1, "w1", "w1", tree({}, 5), tree({}, 5)],
    }[shape]
    packed = msgpack.packb(frame)
    assert len(packed) < executor.FRAME_MAX or shape == "wide"
    return len(packed).to_bytes(4, "big") + packed


def _taken_over_main(conn, name, key, limits, recv_timeout) -> None:  # noqa: ANN001
    """A real executor (started, confined and sandboxed as any) whose client's program takes
    it over at its first request (as a kernel bug would let it) and writes a costly frame
    onto its pipe: the shape its client's identity names (`mallory-SHAPE`; others' executors
    are left as they are)."""
    client = key.split("/", 1)[0]
    if not client.startswith("mallory-"):
        return executor._executor_main(conn, name, key, limits, recv_timeout)
    shape = client.removeprefix("mallory-")

    def taken(host, session, msg, size) -> bytes:  # noqa: ANN001
        frame = _costly_frame(shape)
        view = memoryview(frame)
        while view:
            view = view[os.write(host.channel._fd, view) :]
        time.sleep(60)  # (the network process kills it)
        return b""

    executor.answer = taken  # (this process is the executor's: no one else's code changes)
    executor._executor_main(conn, name, key, limits, recv_timeout)


@pytest.mark.parametrize("shape", ["wide", "long", "tree", "deep", "maps"])
def test_a_costly_frame_from_a_taken_over_executor_ends_it_undecoded(shape, monkeypatch):
    # Frames from an executor were decoded by plain msgpack: one of ~1M empty lists built
    # them all (some 70 MB, 0.1-0.3 s holding the network process's GIL) before its shape
    # was refused. Now its size, then caps on what it holds, are checked first.
    monkeypatch.setattr(executor, "_executor_main", _taken_over_main)  # (its start's target)
    with gg.local_grid(1, isolate=True) as grid:
        mallory = second_client(grid, f"mallory-{shape}")
        victim = second_client(grid, "victim")
        a = torch.randn(4)
        mine = a.send(victim.workers[0])
        tracemalloc.start()
        try:
            tracemalloc.reset_peak()
            before, _ = tracemalloc.get_traced_memory()
            with pytest.raises(gg.SessionLost, match="sent a frame the worker refused") as lost:
                a.send(mallory.workers[0])
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert lost.value.worker == "w0"
        # (what it read: the frame, twice; before, the lists it built: 50-80 MB)
        assert peak - before < 4 * executor.FRAME_MAX + (1 << 20)
        assert torch.equal((mine + 0).get(), a), "the worker no longer serves others"
        mallory.close()
        victim.close()
