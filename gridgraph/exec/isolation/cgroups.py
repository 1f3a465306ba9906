"""A cgroup per executor: how many threads, and how much memory, a taken-over executor gets.

The sandbox (sandbox.py) lets an executor start threads, which torch needs, and the kernel
exempts uid 0 from RLIMIT_NPROC: a taken-over executor of a worker run as root could start
threads until the machine's process table was full. Its address-space limit does not see
the pages of the shared files it writes (executor.py), nor does the OOM killer's score: it
could hold memory past its limits, and the kernel then killed other processes.

State: the cgroups this process made, one per live executor and controller (`confine`
makes them, `free` removes them).
Policy: each executor runs in cgroups of its own, children of the worker's: `pids` with a
maximum of `max_tasks()` (torch's intra-op pool and Python's few threads fit; a bomb stops
there), and `memory` with the limit its worker gives (`executor.memory_limit`): past it the
kernel kills that executor, and only it. Where a controller's cgroup cannot be made
(cgroup v2 below the root without delegation, or no permission), executors run without
that bound, and the worker names the gap when it starts (`sandbox.missing`).
"""

from __future__ import annotations

import itertools
import os
from functools import cache

PREFIX = "gridgraph-executor-"
_made = itertools.count()
_LIMIT_FILE = {("pids", 1): "pids.max", ("pids", 2): "pids.max",
               ("memory", 1): "memory.limit_in_bytes", ("memory", 2): "memory.max"}  # fmt: skip


def max_tasks() -> int:
    """Threads (tasks) one executor may run at once."""
    return 64 + 2 * (os.cpu_count() or 1)


@cache
def parent(controller: str) -> tuple[str, int] | None:
    """The directory of a `controller` cgroup this process may make children in, and its
    cgroup version; None if there is none. The cgroups of executors whose worker was killed
    before it could remove them are removed here."""
    found = _parent(controller)
    if found is not None:
        for name in os.listdir(found[0]):
            worker = name.removeprefix(PREFIX).split("-")[0]
            if name.startswith(PREFIX) and worker.isdigit() and not _alive(int(worker)):
                _remove(os.path.join(found[0], name))  # (one still in use is not empty: kept)
    return found


def confine(pid: int, memory: int | None) -> list[str]:
    """Move process `pid` (an executor not yet serving) into cgroups of its own: at most
    `max_tasks()` tasks, and `memory` bytes (None: no memory bound). The directories made,
    to `free` once the process is gone (those of the controllers to be had)."""
    wanted = {"pids": max_tasks()} | ({"memory": memory} if memory is not None else {})
    name, made = f"{PREFIX}{os.getpid()}-{next(_made)}", []
    for controller, value in wanted.items():
        found = parent(controller)
        if found is None:
            continue
        base, version = found
        path = os.path.join(base, name)
        try:
            if path not in made:
                os.mkdir(path)
                made.append(path)
            _write(os.path.join(path, _LIMIT_FILE[controller, version]), str(value))
            _write(os.path.join(path, "cgroup.procs"), str(pid))
        except OSError:
            continue  # that bound is missing: the worker warned at start
    return made


def free(paths: list[str]) -> None:
    """Remove the cgroups `confine` made, once their process is gone."""
    for path in paths:
        _remove(path)


def _parent(controller: str) -> tuple[str, int] | None:
    mounts = _cgroup_mounts()
    membership = _read("/proc/self/cgroup")
    for line in membership.splitlines():
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(",") and mounts.get(controller):  # cgroup v1
            here = os.path.join(mounts[controller], path.lstrip("/"))
            ok = os.path.isdir(here) and os.access(here, os.W_OK)
            return (here, 1) if ok else None
    root = mounts.get("cgroup2")
    if root and membership.startswith("0::/\n"):  # v2, at its root
        try:
            _write(os.path.join(root, "cgroup.subtree_control"), f"+{controller}")
            return root, 2
        except OSError:
            return None
    return None


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


def _alive(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")


def _remove(path: str) -> None:
    try:
        os.rmdir(path)
    except OSError:  # not empty, or gone already
        pass


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
