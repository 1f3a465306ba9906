"""gridgraph: distributed PyTorch over a peer-to-peer grid, recorded lazily and placed.

import torch, gridgraph as gg

with gg.local_grid(3) as grid:
    w0, w1, w2 = grid.workers
    x = torch.randn(64, 32).send(w0)
    W = torch.randn(32, 8).send(w1)
    with gg.trace():
        y = torch.relu(x @ W).sum(1)
    print(y.compute().location, y.get())
"""

from __future__ import annotations

import torch

from gridgraph.errors import (
    GridError,
    GridHint,
    PlacementError,
    RecordError,
    RemoteError,
    SessionLost,
    WorkerLost,
)
from gridgraph.exec.client.compile import Compiled, RecompileWarning, compile
from gridgraph.exec.grid import Grid, WorkerRef, bring_home, local_grid
from gridgraph.exec.ipfs.client import connect
from gridgraph.exec.safety.limits import Limits
from gridgraph.inspect import explain, visualize
from gridgraph.trace.pointer import RemoteTensor
from gridgraph.trace.record import on as _on
from gridgraph.trace.record import trace

__all__ = [
    "Compiled",
    "Grid",
    "GridError",
    "GridHint",
    "Limits",
    "PlacementError",
    "RecompileWarning",
    "RecordError",
    "RemoteError",
    "RemoteTensor",
    "SessionLost",
    "WorkerLost",
    "WorkerRef",
    "compile",
    "compute",
    "connect",
    "explain",
    "get",
    "local_grid",
    "on",
    "send",
    "trace",
    "visualize",
]


def send(obj, worker: WorkerRef):
    """Send a tensor (returns a pointer) or an nn.Module (moves its parameters) to `worker`."""
    if not isinstance(worker, WorkerRef):
        raise TypeError(f"expected a worker (grid.workers[i]), got {type(worker).__name__}")
    if isinstance(obj, torch.nn.Module):
        return worker.grid.send_module(obj, worker)
    return worker.grid.send(obj, worker)


def get(obj: RemoteTensor | torch.nn.Module) -> torch.Tensor | torch.nn.Module:
    """Bring a value home: a pointer's value as a local tensor, or a sent model made local
    again in place (parameters, buffers and gradients; returns the model). `model.get()`
    is the same.

        model.send(w0); ...; gg.get(model)   # model's tensors are plain local tensors again
    """
    if isinstance(obj, torch.nn.Module):
        return bring_home(obj)
    if isinstance(obj, RemoteTensor):
        return obj.get()
    raise TypeError(f"gg.get takes a pointer or an nn.Module, got {type(obj).__name__}")


def compute(*pointers: RemoteTensor) -> tuple[RemoteTensor, ...]:
    """Run what all these pointers need, together (one plan); they stay remote."""
    for p in pointers:
        if not isinstance(p, RemoteTensor):
            raise TypeError(f"gg.compute takes pointers, got {type(p).__name__}")
    owners = {id(p._owner): p._owner for p in pointers}
    for owner in owners.values():
        owner.compute([p for p in pointers if p._owner is owner])
    return pointers


def on(worker: WorkerRef):
    """Place the ops recorded in this block on `worker`: `with gg.on(w1): ...`."""
    if not isinstance(worker, WorkerRef):
        raise TypeError(f"expected a worker (grid.workers[i]), got {type(worker).__name__}")
    return _on(worker.name)


def _send_method(self, worker: WorkerRef):
    return send(self, worker)


# x.send(w) and model.send(w), as in the original Grid API; model.get() brings it home.
torch.Tensor.send = _send_method
torch.nn.Module.send = _send_method
torch.nn.Module.get = get
