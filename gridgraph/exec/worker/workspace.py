"""What a session's programs run on: its tensors, its prepared programs, its random stream.

A `Session` (session.py) is what the worker's network process keeps for a client: request
records, the queue, transfers in and out. Its `Workspace` is what running the client's
programs needs:

    store      its tensors by value id (store.py)
    programs   its prepared programs by plan id (prepare.py), the PROGRAMS_KEPT latest used
    rng        its random stream (`worker.manual_seed` seeds only this)
    ops_run    ops its runs have run

In-process, a session's own workspace holds all of it. With isolation, the session's
executor process holds the workspace that counts (isolation/executor.py), and the network
process's stays empty. Its bytes (`memory()`) count against the session's memory limit.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from gridgraph.exec.worker.ops import RandomState
from gridgraph.exec.worker.store import ObjectStore

PROGRAMS_KEPT = 64  # prepared programs kept per session, least recently used dropped


class Workspace:
    """A session's tensors, prepared programs and random stream; see the module docstring."""

    def __init__(self) -> None:
        self.store = ObjectStore()
        self.programs: OrderedDict[int, Any] = OrderedDict()  # plan id -> prepare.Program
        self.rng = RandomState()
        self.ops_run = 0
        self._program_bytes = 0

    def memory(self) -> int:
        """Bytes it holds: its tensors' storages and its programs."""
        return self.store.stored_bytes + self._program_bytes

    def add_program(self, plan_id: int, program: Any) -> None:
        """Keep a prepared program (its `nbytes` counted), dropping the least recently used
        past PROGRAMS_KEPT."""
        old = self.programs.pop(plan_id, None)
        if old is not None:
            self._program_bytes -= old.nbytes
        self.programs[plan_id] = program
        self._program_bytes += program.nbytes
        while len(self.programs) > PROGRAMS_KEPT:
            _, dropped = self.programs.popitem(last=False)
            self._program_bytes -= dropped.nbytes

    def clear(self) -> int:
        """Drop everything; the number of tensors freed."""
        n = self.store.clear()
        self.programs.clear()
        self._program_bytes = 0
        return n
