"""Errors users see."""

from __future__ import annotations


class GridError(RuntimeError):
    """Wrong use of a grid: a closed grid, a worker of another grid, an unsupported tensor."""


class GridHint(UserWarning):
    """A warning that something would run faster another way (shown once per place)."""


class RecordError(GridError):
    """A torch call on pointers that gridgraph cannot record; the message says why."""


class PlacementError(GridError):
    """The graph cannot be placed as asked: conflicting aliasing, an unknown pin, no room."""


class RemoteError(RuntimeError):
    """An op failed on a worker, or the worker refused a whole request.

    `.worker` ran it, `.op` is the ATen op ("" for a refused request), `.where` is the
    file:line of the user's code that recorded it, `.reads` what the op read (by your
    names: `features.0.weight`, `x`, else `op@file:line`) and `.remote_traceback` the
    worker's traceback summary.
    """

    def __init__(
        self,
        worker: str,
        op: str,
        message: str,
        where: str = "<unknown>",
        remote_traceback: str = "",
        reads: list[str] | None = None,
    ) -> None:
        self.worker, self.op, self.where = worker, op, where
        self.remote_traceback = remote_traceback
        self.remote_message = message
        self.reads = list(reads or [])
        if op:
            headline = f"{op} failed on worker {worker!r} (recorded at {where}"
            headline += f", reading {', '.join(self.reads)})" if self.reads else ")"
        else:
            headline = f"worker {worker!r} refused the request"
        super().__init__(f"{headline}:\n  {message}")


class WorkerLost(RuntimeError):
    """A worker stopped answering; `.worker` names it and `.values` the tensors lost with it
    (by your names: `2.weight (8, 8) torch.float32`): those stored there, or being made
    there when it was lost. `.hint` says what to do."""

    def __init__(self, worker: str, values: list[str] | None = None, hint: str = "") -> None:
        self.worker = worker
        self.values = values or []
        self.hint = hint
        lost = f"; lost tensors: {', '.join(self.values)}" if self.values else ""
        todo = f"; {hint}" if hint else ""
        super().__init__(f"worker {worker!r} stopped answering{lost}{todo}")


class SessionLost(RemoteError):
    """This client's session on a worker ended: the process running its programs crashed,
    ran out of memory or past the worker's time limit, or the worker ended the session (its
    lease ran out, or its peer opened more sessions than the worker allows). The tensors it
    held there are gone (`.worker` names the worker, `.cause` says why); other workers and
    clients carry on."""

    def __init__(self, worker: str, cause: str) -> None:
        super().__init__(worker, "<session>", cause)
        self.cause = cause
        self.args = (cause,)
