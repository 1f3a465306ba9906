"""The executor's sandbox (exec/isolation/sandbox.py): a client's program that owns its executor
process, through a kernel bug, reaches nothing outside it.

Each attack runs in a process forked by the executors' forkserver that entered the sandbox as
an executor does. The same call made outside the sandbox succeeds, so each refusal is the
sandbox's doing. A live executor of an isolating grid is checked to be in the sandbox, and
to die with its worker.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import importlib
import os
import resource
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
from multiprocessing import reduction

import pytest
import torch

import gridgraph as gg
from gridgraph.exec.isolation import cgroups, executor, sandbox
from gridgraph.exec.safety.limits import Limits

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")


def _attacks(worker: int, secret: str, planted: str, port: int, pair: socket.socket) -> dict:
    """What a taken-over executor would try, each a call that succeeds outside the sandbox:
    `worker` is the worker's pid, `secret` a file of the worker's, `port` a listening
    loopback port (Kubo's RPC API, say), `pair` one end of a socket pair (as its pipe to
    the worker is)."""
    libc = ctypes.CDLL(None, use_errno=True)

    def start_a_process() -> None:
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)

    def run_a_program() -> None:
        os.waitpid(os.posix_spawn("/bin/true", ["true"], os.environ), 0)

    def keep_running_when_the_worker_dies() -> None:
        if libc.prctl(1, 0, 0, 0, 0) != 0:  # PR_SET_PDEATHSIG: none
            raise OSError(ctypes.get_errno(), "prctl")

    def read_the_workers_memory() -> None:
        with open(f"/proc/{worker}/mem", "rb") as mem:
            mem.seek(0x400000)

    def share_memory_with_anyone() -> None:
        segment = libc.shmget(0, 4096, 0o1600)  # IPC_PRIVATE, IPC_CREAT | 0600
        if segment < 0:
            raise OSError(ctypes.get_errno(), "shmget")
        libc.shmctl(segment, 0, None)  # IPC_RMID

    def type_into_its_terminal() -> None:
        fcntl.ioctl(0, 0x5412, b"x")  # TIOCSTI: the operator's shell would read it

    return {
        "signal the worker": lambda: os.kill(worker, 0),
        "limit the worker": lambda: resource.prlimit(
            worker, resource.RLIMIT_NOFILE, resource.prlimit(worker, resource.RLIMIT_NOFILE)
        ),
        "change the mode of the worker's files": lambda: os.chmod(
            secret, os.stat(secret).st_mode & 0o7777
        ),
        "share memory with anyone": share_memory_with_anyone,
        "type into its terminal": type_into_its_terminal,
        "hold memory its limits do not see": lambda: os.close(os.memfd_create("hoard")),
        # (descriptors in flight count against one budget per user: one executor filled it
        # for all of them)
        "put descriptors in flight": lambda: socket.send_fds(pair, [b"x"], [0]),
        "take a handle on the worker": lambda: os.close(os.pidfd_open(worker)),
        "lower the worker's priority": lambda: os.setpriority(
            os.PRIO_PROCESS, worker, os.getpriority(os.PRIO_PROCESS, worker)
        ),
        "start a process": start_a_process,
        "run a program": run_a_program,
        "undo its death signal": keep_running_when_the_worker_dies,
        "connect to Kubo's API": lambda: socket.create_connection(("127.0.0.1", port)).close(),
        "read the worker's files": lambda: open(secret).read(),
        "write a file": lambda: open(planted, "w").close(),
        "read the worker's memory": read_the_workers_memory,
    }


def _from_inside(conn, worker: int, secret: str, planted: str, port: int) -> None:
    """The taken-over executor: enter the sandbox as executors do, then try each attack and
    some honest work, and report what happened."""
    executor._let_go_of_the_worker()
    pair, _ = socket.socketpair()
    sandbox.enter()
    outcome = {}
    for name, attack in _attacks(worker, secret, planted, port, pair).items():
        try:
            attack()
            outcome[name] = "done"
        except OSError as e:
            outcome[name] = e.errno
    a = torch.randn(400, 300, generator=torch.Generator().manual_seed(0))
    torch.set_num_threads(2)  # threads still start
    outcome["mm"] = torch.mm(a, a.T).tolist()  # (a tensor would travel through /dev/shm)
    done = []
    thread = threading.Thread(target=lambda: done.append(importlib.import_module("colorsys")))
    thread.start()
    thread.join()
    outcome["import"] = done[0].__name__
    conn.send(outcome)


@pytest.fixture
def target(tmp_path):
    secret = tmp_path / "worker.key"
    secret.write_text("the worker's private key")
    listener = socket.create_server(("127.0.0.1", 0))
    yield os.getpid(), str(secret), str(tmp_path / "planted"), listener.getsockname()[1]
    listener.close()


def test_a_taken_over_executor_can_do_nothing_outside_its_session(target):
    pair, other = socket.socketpair()
    for name, attack in _attacks(*target, pair).items():  # each works from outside
        if name not in ("write a file", "type into its terminal"):
            attack()
    pair.close()
    other.close()

    ctx = executor._context()
    ours, theirs = ctx.Pipe()
    inside = ctx.Process(target=_from_inside, args=(theirs, *target), daemon=True)
    inside.start()
    assert ours.poll(60), f"the sandboxed process sent nothing (exit code {inside.exitcode})"
    outcome = ours.recv()
    inside.join(10)
    refused = {"signal the worker", "take a handle on the worker", "start a process",
               "run a program", "undo its death signal", "lower the worker's priority",
               "connect to Kubo's API", "limit the worker", "share memory with anyone",
               "change the mode of the worker's files", "type into its terminal",
               "hold memory its limits do not see", "put descriptors in flight"}  # fmt: skip
    if sandbox.landlock_abi() >= 1:  # the files, and /proc, are Landlock's
        refused |= {"read the worker's files", "write a file", "read the worker's memory"}
    got = {name: outcome[name] for name in refused}
    assert all(code in (1, 13) for code in got.values()), got  # EPERM or EACCES
    assert not os.path.exists(target[2])
    a = torch.randn(400, 300, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(torch.tensor(outcome["mm"]), a @ a.T)
    assert outcome["import"] == "colorsys"


def _status(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/status") as status:
        return dict(line.rstrip("\n").split(":\t", 1) for line in status if ":\t" in line)


def test_a_live_executor_runs_in_the_sandbox():
    limits = Limits(max_client_memory=64 << 20)
    with gg.local_grid(1, limits=limits, isolate=True) as grid:
        a = torch.randn(64, 64)
        x = a.send(grid.workers[0])
        assert torch.equal((x @ x).get(), a @ a)
        session = next(iter(grid.local_workers[0].sessions.values()))
        status = _status(session.executor.process.pid)
        # Its stdout and stderr were the worker's log: it could write lines there that read
        # as the worker's own.
        output = {os.readlink(f"/proc/{session.executor.process.pid}/fd/{fd}") for fd in (1, 2)}
        with open(f"/proc/{session.executor.process.pid}/limits") as f:
            file_size = next(line.split()[3] for line in f if line.startswith("Max file size"))
        made = session.executor.cgroups
        for controller, limit in (("pids", cgroups.max_tasks()),
                                  ("memory", executor.memory_limit(limits))):  # fmt: skip
            if cgroups.parent(controller) is None:  # (the worker warns where it cannot)
                continue
            base, version = cgroups.parent(controller)
            path = next(p for p in made if p.startswith(base))
            with open(f"/proc/{session.executor.process.pid}/cgroup") as f:
                assert any(line.endswith(path[len(base) :]) for line in f.read().split())
            name = {"pids": "pids.max", "memory": "memory.limit_in_bytes"}[controller]
            with open(os.path.join(path, name if version == 1 else "memory.max")) as f:
                assert int(f.read()) == limit
    assert status["Seccomp"] == "2" and status["NoNewPrivs"] == "1"
    assert int(status["CapEff"], 16) == 0 and int(status["CapPrm"], 16) == 0
    # Its shared file's pages lie outside its address-space limit: a taken-over executor
    # filled one past the machine's memory, and the kernel's OOM killer picked other processes.
    assert int(file_size) == executor.largest_message(limits)  # its shared file
    assert output == {os.devnull}
    assert made and not any(os.path.exists(p) for p in made)  # removed with its executor


def _bomb(conn) -> None:
    """A taken-over executor starting threads until it can start no more."""
    executor._let_go_of_the_worker()
    sandbox.enter()
    conn.recv()  # confined by now
    stop, started = threading.Event(), 0
    try:
        while started < 5000:
            threading.Thread(target=stop.wait, daemon=True).start()
            started += 1
    except RuntimeError:
        pass
    conn.send(started)
    stop.set()


@pytest.mark.skipif(cgroups.parent("pids") is None, reason="no pids cgroup can be made here")
def test_a_thread_bomb_stops_at_the_executors_task_limit():
    # The kernel exempts uid 0 from RLIMIT_NPROC: a taken-over executor of a root worker
    # started threads until no process on the machine could start another.
    ctx = executor._context()
    ours, theirs = ctx.Pipe()
    inside = ctx.Process(target=_bomb, args=(theirs,), daemon=True)
    inside.start()
    made = cgroups.confine(inside.pid, None)
    try:
        ours.send("go")
        assert ours.poll(60)
        started = ours.recv()
        assert started < cgroups.max_tasks() < 5000
    finally:
        inside.join(10)
        cgroups.free(made)
    assert made and not any(os.path.exists(p) for p in made)


def _hoard(conn) -> None:
    """A taken-over executor writing into the shared file it was given (its pages lie
    outside its address-space limit) until something stops it."""
    executor._let_go_of_the_worker()
    shared = reduction.recv_handle(conn)  # as an executor gets its shared files
    executor._cap_address_space(64 << 20)
    sandbox.enter()
    conn.recv()  # confined by now
    chunk, written = b"x" * (1 << 20), 0
    while written < (2 << 30):
        written += os.pwrite(shared, chunk, written)
    conn.send(written)  # (not reached: killed first)


@pytest.mark.skipif(cgroups.parent("memory") is None, reason="no memory cgroup can be made")
def test_memory_an_executor_hides_in_a_shared_file_is_bounded_by_its_cgroup():
    # A taken-over executor held 3 GiB in files past its address-space limit, and the OOM
    # killer then took the worker instead.
    ctx = executor._context()
    ours, theirs = ctx.Pipe()
    shared = os.memfd_create("up")
    inside = ctx.Process(target=_hoard, args=(theirs,), daemon=True)
    inside.start()
    reduction.send_handle(ours, shared, inside.pid)
    made = cgroups.confine(inside.pid, 256 << 20)
    try:
        ours.send("go")
        inside.join(60)
        assert inside.exitcode == -signal.SIGKILL  # its cgroup's OOM killer: it, and only it
    finally:
        cgroups.free(made)
        os.close(shared)


_WORKER = """
import threading, time, torch, gridgraph as gg
with gg.local_grid(1, isolate=True) as grid:
    m = torch.randn(5000, 5000, dtype=torch.float64).send(grid.workers[0])
    threading.Thread(target=lambda: torch.linalg.eig(m)[0].get(), daemon=True).start()
    time.sleep(3)  # one op of a minute or more: the executor reads nothing from the worker
    session = next(iter(grid.local_workers[0].sessions.values()))
    print(session.executor.process.pid, flush=True)
    time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        return _status(pid)["State"][0] != "Z"
    except FileNotFoundError:
        return False


def test_executors_die_with_their_worker():
    # Every executor held the pipe end whose closing tells the forkserver that the worker is
    # gone: a killed worker's forkserver, and with it an executor busy in a long op (or taken
    # over, and deaf to its closed pipe), ran on.
    worker = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_WORKER)], stdout=subprocess.PIPE, text=True
    )
    try:
        pid = int(worker.stdout.readline())
        assert _alive(pid)
        worker.send_signal(signal.SIGKILL)
        worker.wait()
        deadline = time.monotonic() + 30
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = _alive(pid)
        if left:
            os.kill(pid, signal.SIGKILL)  # (ours: started by this test's worker)
        assert not left, "the executor outlived its worker"
    finally:
        worker.kill()
        worker.wait()


def test_a_protected_worker_is_not_dumpable():
    # Without it, any process of the worker's user could read the worker's keys from
    # /proc/<pid>/mem (gridgraph worker protects itself when it isolates).
    check = (
        "import ctypes; from gridgraph.exec.isolation import sandbox; libc = ctypes.CDLL(None); "
        "before = libc.prctl(3, 0, 0, 0, 0); sandbox.protect_worker(); "
        "print(before, libc.prctl(3, 0, 0, 0, 0))"  # PR_GET_DUMPABLE
    )
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["1", "0"]


F_SETOWN, F_SETSIG, F_SETOWN_EX, F_OWNER_PID = 8, 10, 15, 1
FIOSETOWN, SIOCSPGRP = 0x8901, 0x8902


def _signal_through_a_file(victim: int, sock: socket.socket) -> dict:
    """Have the kernel send `victim` SIGKILL on our behalf: a pipe's read end owned by it
    (F_SETOWN), its signal set to SIGKILL (F_SETSIG), O_ASYNC on, then a byte written; and
    the other ways to name a file's owner: F_SETOWN_EX, and on a socket (`sock`, as the
    executor's channel to its worker is) FIOSETOWN and SIOCSPGRP. The errno of each step
    that failed, 0 for each that did not."""
    read, write = os.pipe()
    owner = struct.pack("i", victim)
    steps = {
        "F_SETOWN_EX": lambda: fcntl.fcntl(
            read, F_SETOWN_EX, struct.pack("ii", F_OWNER_PID, victim)
        ),  # fmt: skip
        "FIOSETOWN": lambda: fcntl.ioctl(sock.fileno(), FIOSETOWN, owner),
        "SIOCSPGRP": lambda: fcntl.ioctl(sock.fileno(), SIOCSPGRP, owner),
        "F_SETOWN": lambda: fcntl.fcntl(read, F_SETOWN, victim),
        "F_SETSIG": lambda: fcntl.fcntl(read, F_SETSIG, signal.SIGKILL),
        "O_ASYNC": lambda: fcntl.fcntl(
            read, fcntl.F_SETFL, fcntl.fcntl(read, fcntl.F_GETFL) | os.O_ASYNC
        ),  # fmt: skip
        "write": lambda: os.write(write, b"x"),
    }
    outcome = {}
    for name, step in steps.items():
        try:
            step()
            outcome[name] = 0
        except OSError as e:
            outcome[name] = e.errno
    os.close(read)
    os.close(write)
    return outcome


def _signal_from_inside(conn, victim: int) -> None:
    """The taken-over executor, in the sandbox as a kernel without Landlock's signal scope
    (ABI 6; Ubuntu 22.04's, Debian 12's, RHEL 9's) would have it: only seccomp stands."""
    executor._let_go_of_the_worker()
    sock, _ = socket.socketpair()
    abi = sandbox.landlock_abi()
    sandbox.landlock_abi = lambda: min(abi, 5)
    sandbox.enter()
    conn.send(_signal_through_a_file(victim, sock))


def _killed_by_its_signal(victim: subprocess.Popen, within: float) -> bool:
    try:
        victim.wait(within)
    except subprocess.TimeoutExpired:
        return False
    return victim.returncode == -signal.SIGKILL


def test_a_taken_over_executor_cannot_signal_through_a_files_owner():
    # On Landlock ABI below 6 a taken-over executor SIGKILLed another process this way: the
    # kernel sends a file's I/O signal to its owner, and seccomp refused only kill and friends.
    outside, (sock, other) = subprocess.Popen(["sleep", "60"]), socket.socketpair()
    try:  # each step works from outside
        assert set(_signal_through_a_file(outside.pid, sock).values()) == {0}
        assert _killed_by_its_signal(outside, 10)
    finally:
        outside.kill()
        outside.wait()
        sock.close()
        other.close()

    victim = subprocess.Popen(["sleep", "60"])
    try:
        ctx = executor._context()
        ours, theirs = ctx.Pipe()
        inside = ctx.Process(target=_signal_from_inside, args=(theirs, victim.pid), daemon=True)
        inside.start()
        assert ours.poll(60), f"the sandboxed process sent nothing (exit code {inside.exitcode})"
        outcome = ours.recv()
        inside.join(10)
        assert not _killed_by_its_signal(victim, 1), outcome  # (sent as the byte was written)
        assert victim.poll() is None
        for step in ("F_SETOWN", "F_SETOWN_EX", "FIOSETOWN", "SIOCSPGRP", "F_SETSIG"):
            assert outcome[step] == errno.EPERM, outcome
    finally:
        victim.kill()
        victim.wait()


def test_missing_names_what_refuses_signals_without_landlocks_scope(monkeypatch):
    monkeypatch.setattr(sandbox, "landlock_abi", lambda: 5)
    (gap,) = [g for g in sandbox.missing() if "signal scope" in g]
    assert "F_SETOWN" in gap and "seccomp alone refuses signals" not in gap
