"""Real models train on the grid as they do in plain torch.

Each model is trained for 10 steps twice from the same initial weights: once in plain local
torch, once with its parts spread over the grid's 3 workers (and its data on a worker),
each step recorded in `gg.trace()`. The losses must agree step by step: within a relative
1e-5 for feed-forward models and 1e-4 for recurrent ones (longer chains of float32 ops
whose order may differ). A model with dropout draws from the workers' own generators, so it
is checked against itself: two runs with the workers seeded alike agree exactly.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

import gridgraph as gg

STEPS = 10
FEED_FORWARD = 1e-5
RECURRENT = 1e-4


def train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, extra=()) -> list[float]:
    """Loss per step of `STEPS` Adam steps of cross entropy on (x, y)."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(STEPS):
        with gg.trace():
            opt.zero_grad()
            loss = F.cross_entropy(model(x, *extra), y)
            loss.backward()
            opt.step()
        losses.append(loss.item())
    return losses


def train_on_grid(grid, model: nn.Module, parts: list[nn.Module], x, y, extra=()) -> list[float]:
    """`parts` (submodules of `model`) go to the workers in turn; the data to the last one."""
    workers = grid.workers
    for i, part in enumerate(parts):
        part.send(workers[i % len(workers)])
    data = workers[-1]
    return train(model, x.send(data), y.send(data), [t.send(data) for t in extra])


def assert_same_losses(got: list[float], want: list[float], rtol: float) -> None:
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert abs(g - w) <= rtol * abs(w), f"step {step}: {g} on the grid, {w} in torch"


def compare(grid, model: nn.Module, parts, x, y, rtol: float, extra=()) -> None:
    torch.manual_seed(0)
    remote = copy.deepcopy(model)
    want = train(model, x, y, extra)
    got = train_on_grid(grid, remote, parts(remote), x, y, extra)
    assert_same_losses(got, want, rtol)


# --- recurrent -------------------------------------------------------------------------------


class Recurrent(nn.Module):
    def __init__(self, rnn: nn.Module, hidden: int) -> None:
        super().__init__()
        self.rnn = rnn
        self.head = nn.Linear(hidden, 3)

    def forward(self, x):
        out, _ = self.rnn(x)
        return self.head(out[:, -1] if self.rnn.batch_first else out[-1])


def test_lstm_trains_as_in_torch(grid):
    torch.manual_seed(1)
    model = Recurrent(nn.LSTM(4, 8, num_layers=2), 8)
    x, y = torch.randn(5, 6, 4), torch.randint(0, 3, (6,))  # (time, batch, features)
    compare(grid, model, lambda m: [m.rnn, m.head], x, y, RECURRENT)


def test_gru_trains_as_in_torch(grid):
    torch.manual_seed(2)
    model = Recurrent(nn.GRU(4, 8, batch_first=True), 8)  # batch_first: uses transpose_
    x, y = torch.randn(6, 5, 4), torch.randint(0, 3, (6,))
    compare(grid, model, lambda m: [m.rnn, m.head], x, y, RECURRENT)


# --- attention -------------------------------------------------------------------------------


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.encoder(x).mean(1))


def test_transformer_with_dropout_repeats_exactly_with_seeded_workers(grid):
    torch.manual_seed(3)
    model = Encoder()
    x, y = torch.randn(4, 5, 16), torch.randint(0, 3, (4,))
    runs = []
    for seed in (0, 0, 1):
        remote = copy.deepcopy(model)
        grid.manual_seed(seed)
        parts = [*remote.encoder.layers, remote.head]
        runs.append(train_on_grid(grid, remote, parts, x, y))
    assert runs[0] == runs[1]  # bit for bit
    assert runs[0] != runs[2]  # dropout is on: another seed draws other masks


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 16)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 3)

    def forward(self, tokens):
        h = self.embed(tokens)
        a, _ = self.attn(h, h, h)
        return self.head(self.norm(h + a).mean(1))


def test_embedding_attention_layernorm_trains_as_in_torch(grid):
    torch.manual_seed(4)
    model = Attention()
    tokens, y = torch.randint(0, 20, (4, 6)), torch.randint(0, 3, (4,))
    parts = lambda m: [m.embed, m.attn, m.norm, m.head]  # noqa: E731
    compare(grid, model, parts, tokens, y, FEED_FORWARD)


# --- convolution, embedding bags ----------------------------------------------------------------


class ResidualCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # No bias before a batch norm (as in ResNet): it cancels out, so its gradient is
        # float noise, which Adam would blow up into updates that differ run to run.
        conv = lambda n_in: nn.Conv2d(n_in, 8, 3, padding=1, bias=False)  # noqa: E731
        self.stem = nn.Sequential(conv(3), nn.BatchNorm2d(8), nn.ReLU())
        self.block = nn.Sequential(conv(8), nn.BatchNorm2d(8), nn.ReLU(), conv(8))
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        h = self.stem(x)
        h = F.relu(h + self.block(h))
        return self.head(F.adaptive_avg_pool2d(h, 1).flatten(1))


def test_residual_cnn_with_batch_norm_trains_as_in_torch(grid):
    torch.manual_seed(5)
    model = ResidualCNN()
    x, y = torch.randn(4, 3, 6, 6), torch.randint(0, 3, (4,))
    remote = copy.deepcopy(model)
    want = train(model, x, y)
    got = train_on_grid(grid, remote, [remote.stem, remote.block, remote.head], x, y)
    assert_same_losses(got, want, FEED_FORWARD)
    # The running statistics were updated on the workers as in torch.
    bn = remote.stem[1]
    torch.testing.assert_close(bn.running_mean.get(), model.stem[1].running_mean)
    torch.testing.assert_close(bn.running_var.get(), model.stem[1].running_var)


class Bag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(30, 8, mode="mean")
        self.head = nn.Linear(8, 3)

    def forward(self, tokens, offsets):
        return self.head(self.bag(tokens, offsets))


def test_embedding_bag_trains_as_in_torch(grid):
    torch.manual_seed(6)
    model = Bag()
    tokens, offsets = torch.randint(0, 30, (12,)), torch.tensor([0, 3, 7, 8])
    y = torch.randint(0, 3, (4,))
    compare(grid, model, lambda m: [m.bag, m.head], tokens, y, FEED_FORWARD, extra=[offsets])
