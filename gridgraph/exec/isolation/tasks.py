"""A pids cgroup per executor: how many threads a taken-over executor may start.

The sandbox (sandbox.py) lets an executor start threads, which torch needs, and the kernel
exempts uid 0 from RLIMIT_NPROC. Without a bound, a taken-over executor of a worker run as
root could start threads until the machine's process table is full, and then no process
on it, the worker included, could start another.

State: the cgroups this process made, one per live executor (`confine` makes one, `free`
removes it).
Policy: each executor runs in a pids cgroup of its own, a child of the worker's own, with
`pids.max` = `max_tasks()`: torch's intra-op pool and Python's few threads fit, and a bomb
stops there. Where no pids cgroup can be made (cgroup v2 below the root without the pids
controller delegated, or no permission), executors run without the bound, and the worker
names the gap when it starts (`sandbox.missing`).
"""

from __future__ import annotations

import itertools
import os
from functools import cache

_made = itertools.count()


def max_tasks() -> int:
    """Threads (tasks) one executor may run at once."""
    return 64 + 2 * (os.cpu_count() or 1)


@cache
def parent() -> str | None:
    """The directory of a pids cgroup this process may make children in, or None (and the
    cgroups of executors whose worker was killed before it could remove them, removed)."""
    base = _parent()
    if base is not None:
        for name in os.listdir(base):
            worker = name.removeprefix("gridgraph-executor-").split("-")[0]
            if (
                name.startswith("gridgraph-executor-")
                and worker.isdigit()
                and not _alive(int(worker))
            ):
                free(os.path.join(base, name))  # (one still in use is not empty: kept)
    return base


def _alive(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")


def _parent() -> str | None:
    mounts = _cgroup_mounts()
    for line in _read("/proc/self/cgroup").splitlines():
        _, controllers, path = line.split(":", 2)
        if "pids" in controllers.split(",") and mounts.get("pids"):  # cgroup v1
            here = os.path.join(mounts["pids"], path.lstrip("/"))
            return here if os.path.isdir(here) and os.access(here, os.W_OK) else None
    root = mounts.get("cgroup2")
    if root and _read("/proc/self/cgroup").startswith("0::/\n"):  # v2, at its root
        try:
            with open(os.path.join(root, "cgroup.subtree_control"), "w") as control:
                control.write("+pids")
            return root
        except OSError:
            return None
    return None


def confine(pid: int) -> str | None:
    """Move process `pid` (an executor not yet serving) into a pids cgroup of its own, of
    `max_tasks()` tasks; its directory, to `free` once the process is gone (None: no
    cgroup to be had)."""
    base = parent()
    if base is None:
        return None
    path = os.path.join(base, f"gridgraph-executor-{os.getpid()}-{next(_made)}")
    try:
        os.mkdir(path)
        _write(os.path.join(path, "pids.max"), str(max_tasks()))
        _write(os.path.join(path, "cgroup.procs"), str(pid))
    except OSError:
        free(path)
        return None
    return path


def free(path: str | None) -> None:
    """Remove the cgroup `confine` made, once its process is gone (an empty cgroup only)."""
    if path is not None:
        try:
            os.rmdir(path)
        except OSError:
            pass


def _cgroup_mounts() -> dict[str, str]:
    """Where each cgroup v1 controller is mounted (by controller), and v2 ("cgroup2")."""
    found: dict[str, str] = {}
    for line in _read("/proc/self/mounts").splitlines():
        _, where, kind, options, *_ = line.split()
        if kind == "cgroup2":
            found.setdefault("cgroup2", where)
        elif kind == "cgroup":
            for option in options.split(","):
                found.setdefault(option, where)
    return found


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
