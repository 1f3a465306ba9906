"""The main demo: train a small MLP whose layers live on 3 in-process workers, its training
step compiled with `gg.compile` (recorded until it is steady, then replayed).

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
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

        print("where each tensor lives:")
        for name, p in model.named_parameters():
            print(f"  {name:10s} {tuple(p.shape)!s:10s} on {p.location}")
        print(f"  {'x':10s} {tuple(x.shape)!s:10s} on {x.location}")
        print(f"  {'y':10s} {tuple(y.shape)!s:10s} on {y.location}")

        @gg.compile  # recorded while the step changes, then replayed without re-recording
        def train_step(x, y):
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            return loss

        for step in range(1, steps + 1):
            grid.reset_stats()
            replays = train_step.replays
            loss = train_step(x, y)  # runs as one batch per worker
            value = loss.item()  # came back with the run: no message
            stats = grid.stats()
            if step in (1, 2, 3, 4) or step % 5 == 0:
                how = "replayed" if train_step.replays > replays else "recorded"
                print(
                    f"step {step:3d}  loss {value:.4f}  loss on {loss.location}  "
                    f"messages {stats['messages']:3d}  bytes {stats['bytes']:8d}  {how}"
                )

        with gg.trace():
            accuracy = (model(x).argmax(1) == y).float().mean()
        print(f"accuracy {accuracy.item():.3f}")
        print("objects per worker:",
              {w: s["objects"] for w, s in grid.stats()["workers"].items()})  # fmt: skip


if __name__ == "__main__":
    main()
