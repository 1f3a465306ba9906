"""Executor processes: each client session's programs run in a process of their own.

Threat model: a client's program is hostile: it may crash a kernel, exhaust memory or run for
hours. In its own process, that harms only its client; the worker's network process (the
transport, every other session) only supervises. State: the executor holds the session's
store, programs and random stream; the network process, what the transport needs (records,
transfers kept for resending, the inbox: session.py) and an `Executor` handle: the process,
its pipe and two shared files (`_Channel`), its cgroups, its place (of `max_executors`).

Policy:
- start: on the session's first request, forked from a forkserver that imported torch
  already; never from the network process, whose transport threads a fork would copy.
- confinement, before the first request: the sandbox (sandbox.py); an address space capped
  at what it mapped plus `_room`; pids and memory cgroups of its own (cgroups.py: past
  `memory_limit` the kernel kills it, and only it); stdout and stderr to /dev/null; it dies
  with its forkserver, which exits when the worker dies.
- time: a program stops between steps at the time limit; an executor still serving
  KILL_GRACE s later is killed (`_Watchdog`).
- cancel: a client's cancel (`Session.abort`, on the network process's copy of the session)
  is told the executor in an ["abort"] frame by the thread serving the session (it looks
  every CANCEL_TICK s while a request runs): its program stops between ops.
- loss: a crash, kill or time-out ends that session only; its request, and every later one,
  gets an error naming the cause (`gg.SessionLost` on the client).
- wire: nothing crosses as pickle; every frame an executor sends is checked (`request`): its
  size (FRAME_MAX) before it is read, what its msgpack holds (FRAME_CAPS) as it is decoded,
  its data per kind of frame (`data_limits`); a frame refused ends its executor, never the
  network process. The framing section lists the frames.
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import os
import resource
import select
import signal
import struct
import threading
import time
from functools import cache
from multiprocessing import forkserver, reduction, resource_tracker
from multiprocessing.connection import Connection
from typing import Any, Protocol

import msgpack

from gridgraph.exec import wire
from gridgraph.exec.isolation import cgroups, sandbox
from gridgraph.exec.protocol import is_name
from gridgraph.exec.safety.limits import GiB, LimitExceeded, Limits
from gridgraph.exec.worker.run import UpstreamFailed, answer, transfer_key
from gridgraph.exec.worker.session import ExecutorLost, Session

log = logging.getLogger("gridgraph.executor")


class NetworkSide(Protocol):
    """What an executor's supervisor needs of the worker's network process (worker.py):
    its name and limits, and sending and awaiting transfers as encoded messages."""

    name: str
    limits: Limits

    def publish_transfer(
        self, session: Session, dst: str, peer: str, run_value: tuple[int, int], payload: bytes
    ) -> None:
        """Send a transfer to worker `dst` as identity `peer`, and keep it for a resend."""

    def wait_transfer(
        self, session: Session, key: tuple[int, int, str], peer: str, deadline: float,
        ask_after: float,
    ) -> bytes:  # fmt: skip
        """The transfer `key` sent by identity `peer`, as received, waiting until `deadline`
        and asking for a resend after `ask_after` s."""


KILL_GRACE = 2.0  # seconds past its time limit before a request's executor is killed
INLINE_MAX = 64 << 10  # data up to this size rides in the frame itself
SHRINK_PAST = 1 << 20  # a shared file is emptied after a message larger than this
# A frame holds its inline data and, besides, at most a few numbers, two names of at most
# protocol.MAX_NAME characters (4 bytes each at most) or an error text of TEXT_MAX: one
# larger than FRAME_MAX is a broken executor's.
TEXT_MAX = 1024  # characters of an error text in a frame
FRAME_MAX = INLINE_MAX + (16 << 10)
# What a frame's msgpack may hold, checked as it is decoded (wire.unpackb): one flat array of
# at most FRAME_FIELDS fields; no maps, no extension types (each array or map decoded is an
# allocation: a frame of a million empty lists took 70 MB and a tenth of a second to build).
FRAME_FIELDS = 7  # ["recv", run, value, src, peer, seconds, ask_after]
FRAME_CAPS = {
    "max_containers": 1,
    "max_array_len": FRAME_FIELDS,
    "max_map_len": 0,
    "max_ext_len": 0,
    "max_bin_len": INLINE_MAX,
    "max_str_len": FRAME_MAX - INLINE_MAX,
}
# What one read of the pipe asks for: a whole frame with inline data (its other fields are
# two names and a few numbers, as a rule ASCII), and under the size past which malloc maps
# (and unmaps) each buffer.
READ_SIZE = INLINE_MAX + 1024
_LENGTH = struct.Struct("!I")  # a frame's length, before it on the pipe
CANCEL_TICK = 0.05  # while a request runs, how often its server looks for a client's cancel


@cache
def _context() -> multiprocessing.context.BaseContext:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["gridgraph.exec.isolation.preload"])  # torch, warm
    return ctx


def prewarm() -> None:
    """Start the forkserver now, not on a client's first request, and return once it serves
    (it imports torch first: seconds)."""
    ready = _context().Process(target=_nothing, daemon=True)
    ready.start()
    ready.join()


def _nothing() -> None:
    pass


# An executor's exit status when it started a grid itself: multiprocessing runs the user's
# main module again in each process it starts, and one without an `if __name__ ==
# "__main__":` guard starts a grid there (see `refuse_nested_start`).
MAIN_NOT_GUARDED = 75
NOT_GUARDED = (
    "your script starts an isolated grid when imported, and each executor process imports "
    'it again: put that code under `if __name__ == "__main__":`'
)


def refuse_nested_start() -> None:
    """Called before starting executors: in a process that multiprocessing is starting (it
    imports the user's main module first), exit at once, quietly, with MAIN_NOT_GUARDED,
    which its parent reports as NOT_GUARDED (else: a dozen tracebacks, one per process)."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        os._exit(MAIN_NOT_GUARDED)


class Isolation:
    """How a worker runs each session in an executor process of its own (it is the worker's
    `Isolation`: the worker hands this requests and never imports this module)."""

    def prewarm(self) -> None:
        """Start the forkserver now, in the background (see `prewarm`)."""
        threading.Thread(target=prewarm, daemon=True).start()

    def start(
        self,
        worker: str,
        session: str,
        limits: Limits,
        recv_timeout: float,
        places: threading.BoundedSemaphore,
    ) -> Executor:
        """A new executor for `session`, in one of the worker's `places`."""
        return Executor(worker, session, limits, recv_timeout, places)


class Executor:
    """The network process's handle on one session's executor process."""

    def __init__(
        self,
        worker: str,
        session: str,
        limits: Limits,
        recv_timeout: float,
        places: threading.BoundedSemaphore,
    ) -> None:
        """Start a session's executor in one of the worker's `places` (one per executor it
        may run, `max_executors`). Raises LimitExceeded if none is free, and OSError if the
        process cannot be started (its place is then free again)."""
        if not places.acquire(blocking=False):
            raise LimitExceeded(
                f"worker {worker} already runs {limits.max_executors} client sessions in "
                f"executor processes (max_executors); try again once one ends"
            )
        self.places: threading.BoundedSemaphore | None = places
        self.lost, self.max_data = None, data_limits(limits)
        self.told_upto = 0  # the cancel (`Session.aborted_upto`) the process was told last
        channel = None
        try:
            ctx = _context()
            conn, child = ctx.Pipe(duplex=True)
            down, up = _shared_file("down"), _shared_file("up")  # (closed with the channel)
            self.channel = channel = _Channel(conn, out=down, into=up)
            self.process = ctx.Process(
                target=_executor_main,
                args=(child, worker, session, limits, recv_timeout),
                name=f"gridgraph-executor-{worker}",
                daemon=True,
            )
            try:
                self.process.start()
                reduction.send_handle(conn, down, self.process.pid)  # before the sandbox
                reduction.send_handle(conn, up, self.process.pid)
            finally:
                child.close()
        except BaseException:
            if channel is not None:
                channel.close()
            places.release()
            raise
        # (before its first request: it has no threads yet, nor anything of the client's)
        self.cgroups = cgroups.confine(self.process.pid, memory_limit(limits))

    def request(self, payload: bytes, held: int, worker: NetworkSide, session: Session) -> bytes:
        """Serve one request in the executor: its reply. Raises ExecutorLost."""
        if self.lost is not None:
            raise ExecutorLost(self.lost)
        kill_at = worker.limits.deadline(time.monotonic()) + KILL_GRACE
        watch = _WATCHDOG.watch(self.process, kill_at)  # whatever read or write it blocks in
        try:
            self.channel.send(["request", held], payload)
            while True:  # (the limit holds even while frames keep coming)
                left = kill_at - time.monotonic()
                if left <= 0:
                    self._end(_over_time(worker.limits))
                if session.aborted_upto > self.told_upto:  # (one writer: this thread)
                    self.told_upto = session.aborted_upto
                    self.channel.send(["abort", self.told_upto])
                if not self.channel.readable(min(left, CANCEL_TICK)):
                    continue
                frame, data = self.channel.receive(self.max_data)
                # Every frame is checked: a kernel bug may have handed the client's program
                # the executor, and then it sends whatever it likes.
                if frame[0] == "reply" and len(frame) == 2 and _count(frame[1]):
                    session.elsewhere = frame[1]  # what the executor holds now
                    return data
                if frame[0] == "transfer" and len(frame) == 5 and data is not None:
                    _, dst, peer, run, value = frame
                    if not (_count(run) and _count(value) and is_name(dst) and is_name(peer)):
                        self._end(f"it sent a malformed frame {frame!r:.60}")
                    if not _own_transfer(data, session.key, worker.name, run, value):
                        self._end("it sent a transfer of another client's run or worker")
                    if _in_file(data):  # it may write the shared file again
                        self.channel.send(["ack"])
                    worker.publish_transfer(session, str(dst), str(peer), (run, value), data)
                elif frame[0] == "recv" and len(frame) == 7 and _recv_frame(frame):
                    self._recv(worker, session, frame, kill_at)
                else:
                    self._end(f"it sent a malformed frame {frame!r:.60}")
        except BadFrame as e:  # (read no further than its check; the process lives on)
            self._end(f"it sent a frame the worker refused ({e})")
        except (EOFError, OSError, ValueError, TypeError):
            self._end(_over_time(worker.limits) if watch.killed else self._cause())
        finally:
            _WATCHDOG.forget(self.process)

    def _recv(self, worker: NetworkSide, session: Session, frame: list, kill_at: float) -> None:
        """Answer a `recv` frame (checked by `_recv_frame`) with the transfer it waits for."""
        _, run, value, src, peer, seconds, ask_after = frame
        key = (int(run), int(value), str(src))
        deadline = min(time.monotonic() + float(seconds), kill_at)
        try:
            payload = worker.wait_transfer(session, key, str(peer), deadline, float(ask_after))
        except UpstreamFailed as e:
            self.channel.send(["recv-error", "upstream", str(e)[:TEXT_MAX]])
        except TimeoutError as e:
            self.channel.send(["recv-error", "timeout", str(e)[:TEXT_MAX]])
        else:
            self.channel.send(["recv-ok"], payload)

    def _cause(self) -> str:
        self.process.join(1.0)
        code = self.process.exitcode
        if code is None:
            return "it broke the protocol"
        if code == MAIN_NOT_GUARDED:
            return NOT_GUARDED
        if code == -signal.SIGKILL:
            return "it was killed (out of memory?)"
        if code < 0:
            return f"it crashed ({signal.Signals(-code).name})"
        return f"it exited with status {code}"

    def _end(self, cause: str) -> None:
        self.lost = cause
        self.close()
        log.warning("executor of a session lost: %s", cause)
        raise ExecutorLost(cause)

    def close(self) -> None:
        """Stop the process (it holds nothing worth saving), and free its place. Closing
        again does nothing: a lost executor is closed when lost and when its session ends."""
        if self.process.is_alive():
            self.process.kill()
        self.process.join(2.0)
        self.channel.close()
        cgroups.free(self.cgroups)
        self.cgroups = []
        places, self.places = self.places, None
        if places is not None:
            places.release()


class _Watch:
    """One request's watch: when its executor is to be killed, and whether it was."""

    __slots__ = ("at", "killed")

    def __init__(self, at: float) -> None:
        self.at, self.killed = at, False


class _Watchdog:
    """Kills an executor still serving a request at its kill time. The request loop checks
    the time between frames, but a frame cut short blocks the read inside it, and would hold
    its session, and its place, for ever. One thread for all executors, started on first
    use; it sleeps till the next deadline."""

    def __init__(self) -> None:
        self._due: dict[Any, _Watch] = {}  # process -> its request's watch (under _lock)
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._wakes_at = math.inf  # when the thread looks next (under _lock)

    def watch(self, process: Any, at: float) -> _Watch:
        """Kill `process` at monotonic time `at` unless forgotten first; the watch says
        whether it was killed."""
        watch = _Watch(at)
        if math.isinf(at):
            return watch
        with self._lock:
            self._due[process] = watch
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="executor-watchdog")
                self._thread.daemon = True
                self._thread.start()
            elif at < self._wakes_at:  # (else it looks in time: no wake-up per request)
                self._cv.notify()
        return watch

    def forget(self, process: Any) -> None:
        with self._lock:
            self._due.pop(process, None)

    def _run(self) -> None:
        with self._lock:
            while True:
                now = time.monotonic()
                for process, watch in list(self._due.items()):
                    if watch.at <= now:
                        del self._due[process]
                        watch.killed = True
                        try:
                            process.kill()
                        except Exception:  # (gone already): the watch goes on for the rest
                            log.exception("watchdog: killing an executor failed")
                self._wakes_at = min((w.at for w in self._due.values()), default=now + 60)
                self._cv.wait(max(0.0, self._wakes_at - now))


_WATCHDOG = _Watchdog()


def _over_time(limits: Limits) -> str:
    """Why an executor killed at its request's kill time was lost."""
    seconds = limits.max_request_seconds or 0
    return f"it ran past the time limit of {seconds:g} s and was killed"


def data_limits(limits: Limits) -> dict[str, float]:
    """The most data the network process reads with each kind of frame from an executor: a
    transfer holds at most a message, and a reply at most the client's memory (its returns
    are counted there before the run) and a header."""
    cap = limits.max_client_memory
    return {
        "transfer": limits.max_message_bytes,
        "reply": math.inf if cap is None else cap + (1 << 20),
    }


def memory_limit(limits: Limits) -> int | None:
    """The memory an executor may hold (its cgroup's limit), None without a client memory
    limit: the room its address space has, its two shared files at their largest (their
    pages lie outside its address space), and torch's own pages."""
    cap = limits.max_client_memory
    if cap is None:
        return None
    return _room(cap) + 2 * int(largest_message(limits)) + GiB


def largest_message(limits: Limits) -> float:
    """The most an executor may write into its shared file at once (inf: no limit)."""
    return max(data_limits(limits).values())


def _room(client_memory: int) -> int:
    """What an executor may take beyond what it holds at start: twice the client's memory
    (an op's inputs, its output and its scratch at once), and working room per core."""
    return 2 * client_memory + GiB + (256 << 20) * (os.cpu_count() or 1)


def _count(v: object) -> bool:
    """Whether `v` is a non-negative int: a byte count, a run or a value id."""
    return type(v) is int and v >= 0


def _own_transfer(data: bytearray, client: str, src: str, run: int, value: int) -> bool:
    """Whether `data` is a transfer of session `client`'s run `run` from worker `src`, first
    value `value`. Its receiver files it under the client and run it names, and takes it as
    this worker's: a taken-over executor could otherwise feed another client's run that
    names this worker. (Raises ValueError if it is no message at all.)"""
    msg = wire.decode(data)
    values = msg.get("values")
    return (
        msg.get("kind") == "transfer"
        and msg.get("client") == client
        and msg.get("src") == src
        and msg.get("run") == run
        and isinstance(values, list)
        and bool(values)
        and values[0] == value
    )


def _recv_frame(frame: list) -> bool:
    """Whether a `recv` frame names a run, a value id and two names (`is_name`), and waits, and asks
    again after, finite, non-negative numbers of seconds (a NaN wait would spin on the lock)."""
    _, run, value, src, peer, seconds, ask_after = frame
    return (
        _count(run)
        and _count(value)
        and is_name(src)
        and is_name(peer)
        and all(type(t) in (int, float) and 0 <= t < math.inf for t in (seconds, ask_after))
    )


# --- framing ---------------------------------------------------------------------------------

# Control frames are msgpack lists over a pipe. Messages (requests, replies, transfers, in the
# wire format, checked by `wire.decode` on the way in) larger than INLINE_MAX travel through
# two anonymous shared-memory files (memfds), one each way, that the network process makes and
# hands the executor once, at its start. An executor never makes a memfd (its pages would
# escape its address-space limit) nor sends a descriptor (descriptors in flight count against
# one per-user budget that every executor shares): the sandbox refuses both. Each file holds
# one message at a time: its reader takes it before the writer writes another (a large
# transfer waits for ["ack"]), and empties a large one's pages once read.
#
# Frames (network process -> executor, and back; `+ data`: inline bytes when small, else the
# size of the message in the sender's shared file):
#     ["request", held] + data  ...  ["reply", held here] + data    (held: bytes the sender
#                                                                   holds for the session)
#     while serving, the executor may send
#     ["transfer", dst, peer, run, value] + data  the network process publishes it to worker
#                                                 `dst`, sealed for identity `peer` (value:
#                                                 the first value id the transfer carries);
#                                                 answered ["ack"] if its data was in the file
#     ["recv", run, value, src, peer, seconds, ask_after]
#                                                 answered ["recv-ok"] + data (the transfer
#                                                 identity `peer` sent), or
#                                                 ["recv-error", "upstream" | "timeout", text];
#                                                 ask_after: when to ask `peer` to send it
#                                                 again (run.resend_wait bounds it)
#     (`peer`: the identity the run's client named for that worker, run.py)
#     ["abort", upto]                             its client cancelled every run numbered up
#                                                 to `upto` (any time; never answered): the
#                                                 executor takes it in between ops
#     ["exit"]


class BadFrame(ValueError):
    """A frame that is not one (its size, its msgpack, its shape or its data): its sender
    is broken, or taken over."""


def _in_file(data: bytes | bytearray) -> bool:
    """Whether `data` travels through a shared file rather than inline in its frame."""
    return len(data) > INLINE_MAX


def _shared_file(name: str) -> int:
    return os.memfd_create(f"gridgraph-{name}", os.MFD_CLOEXEC)


class _Channel:
    """One end of the pipe between the network process and an executor, with the two
    shared files: `out`, where this end writes the messages too large to ride inline, and
    `into`, where the other end does.

    A frame on the pipe is its length (4 bytes, big-endian) and then its msgpack. A frame is
    written with one system call and read with one where the pipe has it whole (a frame
    with inline data fits READ_SIZE): `Connection.send_bytes` and `recv_bytes` cost two
    reads, a dozen Python calls and a BytesIO per frame, on the path of every request, each
    way. Bytes read past a frame wait in `_unread` for the next one. Once closed, the
    channel's descriptors are -1: a use fails (EBADF) rather than reach whatever has the
    number by then."""

    def __init__(self, conn: Connection, out: int, into: int) -> None:
        self.conn, self.out, self.into = conn, out, into
        self._fd = conn.fileno()
        self._unread = bytearray()
        # (Connection.poll makes a selector per call: this path is every request's)
        self._poller = select.poll()
        self._poller.register(self._fd, select.POLLIN)

    def readable(self, seconds: float) -> bool:
        """Whether a frame (or the end of the pipe) can be read within `seconds`. Raises
        OSError once closed (the poll object would wait on whatever has the number now)."""
        if self._fd < 0:
            raise OSError("the executor's pipe is closed")
        if self._unread:  # (a frame's start at least; a hostile executor may never send
            return True  # the rest: the watchdog bounds that read)
        return bool(self._poller.poll(math.ceil(min(seconds, 1e6) * 1000)))

    def send(self, frame: list, data: bytes | bytearray | None = None) -> None:
        """Write `frame`, with `data` inline or, if larger than INLINE_MAX, in `out`."""
        if data is not None and _in_file(data):
            view, done = memoryview(data), 0
            while done < len(view):
                done += os.pwrite(self.out, view[done:], done)
            frame = [*frame, len(data)]
        elif data is not None:
            frame = [*frame, data]
        packed = msgpack.packb(frame)
        view = memoryview(_LENGTH.pack(len(packed)) + packed)
        while view:
            view = view[os.write(self._fd, view) :]

    def receive(self, max_data: dict[str, float]) -> tuple[list, bytearray | None]:
        """A frame and its data (None if it carries none), the data at most `max_data` of
        its kind of frame (no limit for a kind not there). Raises EOFError at the end of
        the pipe, BadFrame on a frame that is not one, decoding no more of it than its size
        and FRAME_CAPS allow."""
        try:
            frame = wire.unpackb(self._frame(), **FRAME_CAPS)
        except wire.WireError as e:
            raise BadFrame(str(e)) from None
        if not isinstance(frame, list) or not frame or not isinstance(frame[0], str):
            raise BadFrame("malformed frame")
        if frame[0] not in ("request", "reply", "transfer", "recv-ok"):
            return frame, None
        last = frame.pop()
        if isinstance(last, bytes):
            return frame, bytearray(last)
        limit = max_data.get(frame[0], math.inf)
        if type(last) is not int or not INLINE_MAX < last <= limit:  # (less rides inline)
            raise BadFrame(f"data of {last!r} bytes")
        data = bytearray(last)  # a copy: the writer cannot change what is checked
        view, done = memoryview(data), 0
        while done < last:
            n = os.preadv(self.into, [view[done:]], done)
            if n == 0:
                raise BadFrame("shared data shorter than announced")
            done += n
        if last > SHRINK_PAST:
            os.ftruncate(self.into, 0)  # its pages go back now, not at the next message
        return frame, data

    def _frame(self) -> bytes:
        """The next frame's msgpack, read whole."""
        self._fill(_LENGTH.size)
        (size,) = _LENGTH.unpack_from(self._unread)
        if not 0 < size <= FRAME_MAX:
            raise BadFrame(f"a frame of {size} bytes, over the {FRAME_MAX} a frame may hold")
        end = _LENGTH.size + size
        self._fill(end)
        frame = bytes(self._unread[_LENGTH.size : end])
        del self._unread[:end]
        return frame

    def _fill(self, n: int) -> None:
        """Read until `_unread` holds `n` bytes."""
        while len(self._unread) < n:
            chunk = os.read(self._fd, max(n - len(self._unread), READ_SIZE))
            if not chunk:
                raise EOFError("the other end closed the pipe")
            self._unread += chunk

    def close(self) -> None:
        """Close the pipe and both files, once: closed twice, their descriptor numbers could
        by then be another session's executor's."""
        self.conn.close()
        for fd in (self.out, self.into):
            if fd >= 0:
                os.close(fd)
        self.out = self.into = self._fd = -1


# --- the executor process ----------------------------------------------------------------------


class _ExecutorHost:
    """What a session's programs see of the worker, from inside the executor (run.Host)."""

    def __init__(self, channel: _Channel, name: str, limits: Limits, recv_timeout: float):
        self.channel, self.name = channel, name
        self.limits, self.recv_timeout = limits, recv_timeout

    def next_frame(self, session: Session) -> tuple[list, bytearray | None]:
        """The next frame from the network process and its data, taking in the cancels
        (["abort"] frames) that come before it."""
        while True:
            frame, data = self.channel.receive({})
            if frame[0] != "abort":
                return frame, data
            _take_cancel(session, frame)

    def heed_cancel(self, session: Session) -> None:
        """Take in the cancels the network process sent (see run.Host): between ops, the
        pipe holds nothing else."""
        while self.channel.readable(0):
            frame, _ = self.channel.receive({})
            if frame[0] != "abort":
                raise ValueError(f"expected a cancel, got {frame!r:.60}")
            _take_cancel(session, frame)

    def transfer(self, session: Session, dst: str, peer: str, msg: dict) -> None:
        data = wire.encode(msg)
        self.channel.send(["transfer", dst, peer, *transfer_key(msg)], data)
        if _in_file(data):  # the shared file is free once the other end read it
            frame, _ = self.next_frame(session)
            if frame != ["ack"]:
                raise ValueError(f"expected an ack, got {frame!r:.60}")

    def receive(
        self,
        session: Session,
        key: tuple[int, int, str],
        peer: str,
        deadline: float,
        ask_after: float,
    ) -> dict:
        run, value, src = key
        seconds = max(0.0, deadline - time.monotonic())
        self.channel.send(["recv", run, value, src, peer, seconds, ask_after])
        frame, data = self.next_frame(session)
        if frame[0] == "recv-ok":
            return wire.decode(data)
        if frame[0] == "recv-error" and frame[1] == "upstream":
            raise UpstreamFailed(str(frame[2]))
        raise TimeoutError(str(frame[2]))


def _take_cancel(session: Session, frame: list) -> None:
    """Apply an ["abort", upto] frame to the executor's copy of the session."""
    if len(frame) == 2 and type(frame[1]) is int:
        session.abort(None, frame[1])


def _executor_main(
    conn: Connection, name: str, key: str, limits: Limits, recv_timeout: float
) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the worker, which kills us
    _let_go_of_the_worker()
    down, up = reduction.recv_handle(conn), reduction.recv_handle(conn)
    channel = _Channel(conn, out=up, into=down)
    _cap_address_space(limits.max_client_memory)
    _cap_file_size(largest_message(limits))
    _write_nowhere()
    sandbox.enter()  # from here on, the client's program may own this process
    session = Session(key, key.split("/", 1)[0])
    host = _ExecutorHost(channel, name, limits, recv_timeout)
    while True:
        try:
            frame, data = host.next_frame(session)
        except EOFError:
            return
        if frame[0] != "request":
            return
        session.elsewhere = int(frame[1])
        msg = wire.decode(data)  # checked by the network process already
        reply = answer(host, session, msg, len(data))
        channel.send(["reply", session.memory() - session.elsewhere], reply)


def _let_go_of_the_worker() -> None:
    """Close the descriptors the forkserver hands every child: the write end of the pipe
    whose end tells the forkserver that the worker is gone, and the resource tracker's. Held
    by an executor, the first keeps the forkserver, and so the executor (its death signal
    comes when the forkserver exits, sandbox.py), alive after the worker dies."""
    server, tracker = forkserver._forkserver, resource_tracker._resource_tracker
    for holder, attribute in ((server, "_forkserver_alive_fd"), (tracker, "_fd")):
        fd = getattr(holder, attribute, None)
        if fd is not None:
            os.close(fd)
            setattr(holder, attribute, None)


def _write_nowhere() -> None:
    """Point the executor's stdout and stderr at /dev/null. They were the worker's, and its
    log goes there: a taken-over executor could write lines that read as the worker's own.
    Nothing is lost: an executor's errors reach its client in replies, and its end reaches
    the worker's log from the network process (`Executor._end`)."""
    null = os.open(os.devnull, os.O_WRONLY)
    for fd in (1, 2):
        os.dup2(null, fd)
    os.close(null)


def _cap_file_size(largest: float) -> None:
    """Cap what the executor can write into a shared file at its largest message: pages of
    a file are outside its address-space limit."""
    if math.isfinite(largest):
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past it fails, no more
        resource.setrlimit(resource.RLIMIT_FSIZE, (int(largest), int(largest)))


def _cap_address_space(client_memory: int | None) -> None:
    """No core dumps; and with a client memory limit, an address space capped at what the
    executor mapped once started (torch maps far more virtual memory than it uses) plus
    `_room`: an allocation past that fails as an op error."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if client_memory is None:
        return
    with open("/proc/self/status") as status:
        mapped = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize"))
    room = _room(client_memory)
    resource.setrlimit(resource.RLIMIT_AS, (mapped + room, mapped + room))
