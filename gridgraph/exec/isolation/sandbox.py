"""The executor's sandbox: what a client's program can reach once it owns its executor.

Threat model: a kernel that trusts its arguments (kernel_checks.py covers the ones known) may
hand a hostile client's program its executor process: its code and its system calls. The
sandbox keeps that client in its own session, away from the worker, other clients' executors,
the worker's keys and the Kubo node. State: none; `enter()` changes the calling process for
good, once, before its first request. Policy (the kernel's; seccomp refuses what `_REFUSED`
and `_SELF_ONLY` list, each group saying why):
- processes: no fork, vfork or exec, no clone but a thread's; signals (also Landlock's signal
  scope, where the kernel has it), scheduling and resource limits for itself only, and no
  file's owner set (the kernel would signal it: fcntl F_SETOWN, ioctl FIOSETOWN); no nice or
  I/O priority change; its death signal (SIGKILL when the forkserver goes) stays;
- memory: no ptrace, process_vm_readv/writev, pidfd_getfd or kcmp, and not dumpable
  (`protect_worker` does that for the network process); no memfd, no System V or POSIX IPC,
  no descriptor sent; a file-size limit on the shared files it writes (executor.py);
- no socket of any kind, namespace, mount, key, BPF, userfaultfd, perf event or io_uring;
- files (Landlock): read only where Python and its libraries live, write nowhere; no change
  to a file's mode, owner, times or extended attributes, and no file watched;
- a session of its own (setsid), and no TIOCSTI or TIOCLINUX ioctl: nothing typed into the
  operator's shell; no capabilities, and no_new_privs (`_drop_capabilities`);
- threads, and memory with the shared files, bounded by pids and memory cgroups of its own
  (cgroups.py), where the worker can make them (the kernel exempts uid 0 from RLIMIT_NPROC).
A refused call fails with EPERM (clone3 with ENOSYS: threads fall back to clone). `missing()`
names what the machine lacks (Landlock before Linux 5.13, seccomp off x86-64 and arm64, the
cgroups); the worker warns of it at start.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import signal
import struct
import sys
from functools import cache

from gridgraph.exec.isolation import cgroups

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long

PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
CLONE_THREAD = 0x10000

# Syscall numbers for the architectures the filter knows; arm64 uses the generic table.
_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_X32_BIT = 0x40000000  # x86-64's x32 ABI: another numbering, refused whole
# fmt: off
_NR = {
    "x86_64": dict(
        kill=62, tkill=200, tgkill=234, rt_sigqueueinfo=129, rt_tgsigqueueinfo=297,
        pidfd_send_signal=424, pidfd_open=434, pidfd_getfd=438, ptrace=101,
        process_vm_readv=310, process_vm_writev=311, process_madvise=440, kcmp=312,
        fork=57, vfork=58, clone=56, clone3=435, execve=59, execveat=322, socket=41,
        socketpair=53, prctl=157, perf_event_open=298, bpf=321, userfaultfd=323,
        unshare=272, setns=308, mount=165, keyctl=250, add_key=248, request_key=249,
        io_uring_setup=425, io_uring_enter=426, io_uring_register=427,
        open_by_handle_at=304, name_to_handle_at=303, setpriority=141,
        sched_setaffinity=203, sched_setscheduler=144, sched_setparam=142,
        sched_setattr=314, ioprio_set=251, migrate_pages=256, move_pages=279,
        seccomp=317, capset=126, prlimit64=302, ioctl=16, fcntl=72, chmod=90, fchmod=91,
        fchmodat=268, fchmodat2=452, chown=92, fchown=93, lchown=94, fchownat=260, utime=132,
        utimes=235, futimesat=261, utimensat=280, setxattr=188, lsetxattr=189,
        fsetxattr=190, removexattr=197, lremovexattr=198, fremovexattr=199, setxattrat=463,
        removexattrat=466, shmget=29, shmat=30, shmctl=31, shmdt=67, semget=64, semop=65,
        semctl=66, semtimedop=220, msgget=68, msgsnd=69, msgrcv=70, msgctl=71, mq_open=240,
        mq_unlink=241, mq_timedsend=242, mq_timedreceive=243, mq_notify=244,
        mq_getsetattr=245, inotify_init=253, inotify_init1=294, inotify_add_watch=254,
        fanotify_init=300, fanotify_mark=301, memfd_create=319, sendmsg=46, sendmmsg=307,
    ),
    "aarch64": dict(
        kill=129, tkill=130, tgkill=131, rt_sigqueueinfo=138, rt_tgsigqueueinfo=240,
        pidfd_send_signal=424, pidfd_open=434, pidfd_getfd=438, ptrace=117,
        process_vm_readv=270, process_vm_writev=271, process_madvise=440, kcmp=272,
        clone=220, clone3=435, execve=221, execveat=281, socket=198, socketpair=199,
        prctl=167, perf_event_open=241, bpf=280, userfaultfd=282, unshare=97, setns=268,
        mount=40, keyctl=219, add_key=217, request_key=218, io_uring_setup=425,
        io_uring_enter=426, io_uring_register=427, open_by_handle_at=265,
        name_to_handle_at=264, setpriority=140, sched_setaffinity=122,
        sched_setscheduler=119, sched_setparam=118, sched_setattr=274, ioprio_set=30,
        migrate_pages=238, move_pages=239, seccomp=277, capset=91, prlimit64=261, ioctl=29,
        fcntl=25,
        fchmod=52, fchmodat=53, fchmodat2=452, fchown=55, fchownat=54, utimensat=88,
        setxattr=5, lsetxattr=6, fsetxattr=7, removexattr=14, lremovexattr=15,
        fremovexattr=16, setxattrat=463, removexattrat=466, shmget=194, shmat=196,
        shmctl=195, shmdt=197, semget=190, semop=193, semctl=191, semtimedop=192,
        msgget=186, msgsnd=189, msgrcv=188, msgctl=187, mq_open=180, mq_unlink=181,
        mq_timedsend=182, mq_timedreceive=183, mq_notify=184, mq_getsetattr=185,
        inotify_init1=26, inotify_add_watch=27, fanotify_init=262, fanotify_mark=263,
        memfd_create=279, sendmsg=211, sendmmsg=269,
    ),
}
# fmt: on
_REFUSED = (
    # other processes: signals, memory, handles
    "tkill rt_sigqueueinfo rt_tgsigqueueinfo pidfd_send_signal pidfd_open pidfd_getfd ptrace "
    "process_vm_readv process_vm_writev process_madvise kcmp migrate_pages move_pages "
    "setpriority ioprio_set "  # (these reach a process group or a user too)
    # new processes and programs (nothing the client starts outlives its executor or runs
    # outside the sandbox), sockets (not Kubo's RPC API, not the forkserver's socket, not the
    # network), namespaces, kernel facilities (io_uring: seccomp would not see its requests)
    "fork vfork execve execveat socket socketpair unshare setns mount keyctl add_key "
    "request_key bpf perf_event_open userfaultfd io_uring_setup io_uring_enter "
    "io_uring_register open_by_handle_at name_to_handle_at "
    # file metadata (Landlock does not cover it; uid 0 owns root's files) and file watches
    "chmod fchmod fchmodat fchmodat2 chown fchown lchown fchownat utime utimes futimesat "
    "utimensat setxattr lsetxattr fsetxattr removexattr lremovexattr fremovexattr "
    "setxattrat removexattrat inotify_init inotify_init1 inotify_add_watch fanotify_init "
    "fanotify_mark "
    # memory its limits do not see (a memfd's pages are outside its address space), and
    # descriptors in flight (one budget per user, which every executor shares)
    "memfd_create sendmsg sendmmsg "
    # System V and POSIX IPC: shared with every process of the user, and outliving it
    "shmget shmat shmctl shmdt semget semop semctl semtimedop msgget msgsnd msgrcv msgctl "
    "mq_open mq_unlink mq_timedsend mq_timedreceive mq_notify mq_getsetattr"
).split()
# calls allowed only when the argument (by index) that names a process names this one: "pid"
# stands for its pid, 0 for "the caller"
_SELF_ONLY = {"kill": (0, ("pid",)), "tgkill": (0, ("pid",)), "prlimit64": (0, (0, "pid")),
              "sched_setaffinity": (0, (0,)), "sched_setscheduler": (0, (0,)),
              "sched_setparam": (0, (0,)), "sched_setattr": (0, (0,))}  # fmt: skip
_TTY_INJECTION = (0x5412, 0x541C)  # ioctl TIOCSTI, TIOCLINUX: type into a terminal
# A file's owner is the process the kernel signals when it is ready (O_ASYNC): any process,
# with any signal (F_SETSIG), which kill's filter never sees. fcntl F_SETOWN, F_SETOWN_EX and
# F_SETSIG, and ioctl FIOSETOWN and SIOCSPGRP (on a socket, as the executor's channel is).
_FILE_OWNER_FCNTL = (8, 15, 10)
_FILE_OWNER_IOCTL = (0x8901, 0x8902)


# Landlock (linux/landlock.h): filesystem rights by bit, how many the kernel's ABI handles
_LANDLOCK_CREATE_RULESET, _LANDLOCK_ADD_RULE, _LANDLOCK_RESTRICT_SELF = 444, 445, 446
_FS_READ_FILE, _FS_READ_DIR = 1 << 2, 1 << 3
_FS_RIGHTS_BY_ABI = {1: 13, 2: 14, 3: 15, 4: 15}  # ABI 5 and later: 16
_NET_BIND_TCP, _NET_CONNECT_TCP = 1, 2  # ABI 4
_SCOPE_ABSTRACT_UNIX_SOCKET, _SCOPE_SIGNAL = 1, 2  # ABI 6
_LIBRARIES = ("/usr/lib", "/usr/lib64", "/lib", "/lib64", "/usr/local/lib", "/etc/ld.so.cache")
_CPU_INFO = ("/sys/devices/system/cpu", "/proc/cpuinfo")  # read as torch's threads start


class SandboxError(RuntimeError):
    """A part of the sandbox that the kernel offers could not be applied."""


@cache
def landlock_abi() -> int:
    """The Landlock ABI version the kernel offers; 0 where it has none."""
    abi = _libc.syscall(_LANDLOCK_CREATE_RULESET, None, 0, 1)  # _VERSION
    return max(0, abi)


def missing() -> list[str]:
    """The parts of the sandbox this machine's kernel cannot apply, named for a warning."""
    gaps = []
    if platform.machine() not in _NR:
        gaps.append(f"seccomp filter (no syscall table for {platform.machine()})")
    if landlock_abi() < 1:
        gaps.append("Landlock (Linux 5.13 or later): executors can read the worker's files")
    elif landlock_abi() < 6:
        gaps.append(
            "Landlock signal scope (Linux 6.12 or later): signals to other processes are "
            "refused by seccomp alone (kill, tgkill, pidfd and rt_sigqueueinfo calls, and a "
            "file's owner set by fcntl F_SETOWN or ioctl FIOSETOWN)"
        )
    if cgroups.parent("pids") is None:
        gaps.append("a pids cgroup: an executor's threads are not bounded")
    if cgroups.parent("memory") is None:
        gaps.append("a memory cgroup: an executor's shared files are bounded by size only")
    return gaps


def protect_worker() -> None:
    """Make the worker's network process not dumpable: no process of its user without
    CAP_SYS_PTRACE may read or write its memory through /proc (its keys live there)."""
    _prctl(PR_SET_DUMPABLE, 0)


def enter() -> None:
    """Confine the calling process for good (see the module's policy). Call it in a process
    with one thread: Landlock binds only the calling thread, and threads started later
    inherit both Landlock and the seccomp filter."""
    if _threads() != 1:
        raise SandboxError(f"the sandbox is entered by a process with {_threads()} threads")
    parent = os.getppid()
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # killed when the forkserver goes
    if os.getppid() != parent:  # it went before the call took effect
        os._exit(1)
    try:
        os.setsid()  # no controlling terminal (to type commands into), no process group
    except PermissionError:  # already a group's leader: TIOCSTI is refused below all the same
        pass
    _drop_capabilities()
    _prctl(PR_SET_NO_NEW_PRIVS, 1)
    if landlock_abi() >= 1:
        _restrict_files(landlock_abi())
    # not dumpable: no process of its user without CAP_SYS_PTRACE opens its /proc/pid/mem
    _prctl(PR_SET_DUMPABLE, 0)
    if platform.machine() in _NR:
        _install_filter(platform.machine(), os.getpid())


def _threads() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("Threads:"))


def _prctl(option: int, value: int) -> None:
    if _libc.prctl(option, ctypes.c_ulong(value), 0, 0, 0) != 0:
        e = ctypes.get_errno()
        raise SandboxError(f"prctl({option}, {value}): {os.strerror(e)}")


def _syscall(name: str, *args: object) -> int:
    """Make system call `name` (by this machine's number); raise SandboxError if it fails."""
    return _call(_NR[platform.machine()][name], name, *args)


def _call(number: int, name: str, *args: object) -> int:
    result = _libc.syscall(number, *args)
    if result < 0:
        raise SandboxError(f"{name}: {os.strerror(ctypes.get_errno())}")
    return result


def _drop_capabilities() -> None:
    """Empty the effective, permitted and inheritable sets, and the ambient one: a worker
    that runs as root gives its executors none of root's powers. They keep uid 0, and with
    it owner access to root's files, which Landlock confines (and seccomp, their metadata)."""
    if _libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) != 0:
        if ctypes.get_errno() != errno.EINVAL:  # (a kernel without ambient capabilities)
            raise SandboxError(f"clearing ambient capabilities: {os.strerror(ctypes.get_errno())}")
    header = ctypes.create_string_buffer(struct.pack("Ii", 0x20080522, 0), 8)  # v3, this process
    data = ctypes.create_string_buffer(24)  # two {effective, permitted, inheritable}: all zero
    if platform.machine() in _NR:
        _syscall("capset", header, data)
    elif os.geteuid() == 0:
        raise SandboxError(f"cannot drop root's capabilities on {platform.machine()}")


def _restrict_files(abi: int) -> None:
    """Landlock: read files and list directories only where Python's code and the shared
    libraries live; everything else (the worker's keys, the Kubo repository, /proc), writes
    included, is refused."""
    fs = (1 << _FS_RIGHTS_BY_ABI.get(abi, 16)) - 1
    net = _NET_BIND_TCP | _NET_CONNECT_TCP if abi >= 4 else 0
    scoped = _SCOPE_ABSTRACT_UNIX_SOCKET | _SCOPE_SIGNAL if abi >= 6 else 0
    attr = struct.pack("QQQ", fs, net, scoped)[: 8 if abi < 4 else 16 if abi < 6 else 24]
    attr = ctypes.create_string_buffer(attr, len(attr))
    ruleset = _call(_LANDLOCK_CREATE_RULESET, "landlock_create_ruleset", attr, len(attr), 0)
    try:
        for path in readable_paths():
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            try:
                rights = _FS_READ_FILE | (_FS_READ_DIR if os.path.isdir(path) else 0)
                rule = ctypes.create_string_buffer(struct.pack("=Qi", rights, fd), 12)  # packed
                _call(_LANDLOCK_ADD_RULE, f"landlock_add_rule({path})", ruleset, 1, rule, 0)
            finally:
                os.close(fd)
        _call(_LANDLOCK_RESTRICT_SELF, "landlock_restrict_self", ruleset, 0)
    finally:
        os.close(ruleset)


def readable_paths() -> list[str]:
    """What an executor may read: Python's installation, the directories it imports from
    (not the working directory), this package, the shared libraries and the CPU list."""
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    prefixes = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    imports = {p for p in sys.path if os.path.isabs(p) and p != os.getcwd()}
    wanted = sorted(prefixes | imports | {here, *_CPU_INFO, *_LIBRARIES})
    return [p for p in wanted if os.path.exists(p)]


def _install_filter(machine: str, pid: int) -> None:
    """The seccomp filter: refuse the calls of the policy, allow every other."""
    nr = _NR[machine]
    eperm = _errno(errno.EPERM)
    program = [_load(4), _jump(_JEQ, _AUDIT_ARCH[machine], 1, 0), _ret(_KILL)]
    if machine == "x86_64":
        program += [_load(0), _jump(_JGE, _X32_BIT, 0, 1), _ret(eperm)]
    for name in _REFUSED:
        if name in nr:
            program += _when(nr[name], [_ret(eperm)])
    for name, (arg, allowed) in _SELF_ONLY.items():
        values = [pid if v == "pid" else v for v in allowed]
        program += _when(nr[name], _if_arg(arg, _JEQ, values, _ret(_ALLOW), _ret(eperm)))
    program += _when(nr["clone"], _if_arg(0, _JSET, [CLONE_THREAD], _ret(_ALLOW), _ret(eperm)))
    program += _when(nr["clone3"], [_ret(_errno(errno.ENOSYS))])  # threads fall back to clone
    # (its death signal cannot be undone)
    program += _when(nr["prctl"], _if_arg(0, _JEQ, [PR_SET_PDEATHSIG], _ret(eperm), _ret(_ALLOW)))
    refused_ioctls = (*_TTY_INJECTION, *_FILE_OWNER_IOCTL)
    program += _when(nr["ioctl"], _if_arg(1, _JEQ, refused_ioctls, _ret(eperm), _ret(_ALLOW)))
    program += _when(nr["fcntl"], _if_arg(1, _JEQ, _FILE_OWNER_FCNTL, _ret(eperm), _ret(_ALLOW)))
    program.append(_ret(_ALLOW))
    filters = (_SockFilter * len(program))(*program)
    fprog = _SockFprog(len(program), filters)
    _syscall("seccomp", 1, 1, ctypes.byref(fprog))  # SET_MODE_FILTER, FILTER_FLAG_TSYNC


# --- classic BPF, as seccomp reads it ------------------------------------------------------

_ALLOW, _KILL = 0x7FFF0000, 0x80000000  # SECCOMP_RET_ALLOW, SECCOMP_RET_KILL_PROCESS
_JEQ, _JGE, _JSET = 0x15, 0x35, 0x45  # BPF_JMP | BPF_K with ==, >= and & (any bit set)


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte),
                ("k", ctypes.c_uint)]  # fmt: skip


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def _when(number: int, then: list[_SockFilter]) -> list[_SockFilter]:
    """Run `then` (which must end in a return) for syscall `number`; else go on past it."""
    return [_load(0), _jump(_JEQ, number, 0, len(then)), *then]


def _if_arg(arg: int, test: int, values: list | tuple, yes: _SockFilter, no: _SockFilter) -> list:
    """Return `yes` if the low word of argument `arg` passes `test` against any of `values`,
    else `no`."""
    n = len(values)
    tests = [_jump(test, v, n - 1 - i, 1 if i == n - 1 else 0) for i, v in enumerate(values)]
    return [_load(16 + 8 * arg), *tests, yes, no]


def _load(offset: int) -> _SockFilter:
    """A = the 32-bit word at `offset` of seccomp_data (0: syscall number, 4: arch, 16 + 8i:
    the low word of argument i, on a little-endian machine)."""
    return _SockFilter(0x20, 0, 0, offset)  # BPF_LD | BPF_W | BPF_ABS


def _jump(code: int, k: int, jt: int, jf: int) -> _SockFilter:
    return _SockFilter(code, jt, jf, k & 0xFFFFFFFF)


def _ret(value: int) -> _SockFilter:
    return _SockFilter(0x06, 0, 0, value)  # BPF_RET | BPF_K


def _errno(number: int) -> int:
    return 0x00050000 | number  # SECCOMP_RET_ERRNO
