"""The main demo: train a small MLP whose layers live on 3 in-process workers.

Run: python -m gridgraph demo   (or: gridgraph demo)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import gridgraph as gg


def main(steps: int = 20) -> None:
    torch.manual_seed(0)
    X = torch.randn(256, 16)
    Y = (X[:, :4].sum(1) > 0).long()  # a target the model can learn
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                          nn.Linear(64, 2))  # fmt: skip

    with gg.local_grid(3) as grid:
        w0, w1, w2 = grid.workers
        model[0].send(w0)
        model[2].send(w1)
        model[4].send(w2)
        x, y = X.send(w0), Y.send(w2)
        opt = torch.optim.Adam(model.parameters(), lr=0.01)

        print("where each tensor lives:")
        for name, p in model.named_parameters():
            print(f"  {name:10s} {tuple(p.shape)!s:10s} on {p.location}")
        print(f"  {'x':10s} {tuple(x.shape)!s:10s} on {x.location}")
        print(f"  {'y':10s} {tuple(y.shape)!s:10s} on {y.location}")

        for step in range(1, steps + 1):
            grid.reset_stats()
            with gg.trace():  # recorded, then run as one batch per worker
                opt.zero_grad()
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
            value = loss.item()
            stats = grid.stats()
            if step == 1 or step % 5 == 0:
                print(
                    f"step {step:3d}  loss {value:.4f}  loss on {loss.location}  "
                    f"messages {stats['messages']:3d}  bytes {stats['bytes']:8d}"
                )

        with gg.trace():
            accuracy = (model(x).argmax(1) == y).float().mean()
        print(f"accuracy {accuracy.item():.3f}")
        print("objects per worker:",
              {w: s["objects"] for w, s in grid.stats()["workers"].items()})  # fmt: skip


if __name__ == "__main__":
    main()
