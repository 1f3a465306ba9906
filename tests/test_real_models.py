"""Real models train through pointers as in plain torch.

- torchvision's `resnet18` and `mobilenet_v3_small`, random weights, split over the 3 workers
  of a local grid, 3 steps of SGD with momentum in `gg.trace()`;
- a small GPT-style decoder (token and position embeddings, causal attention both as
  `nn.MultiheadAttention` and as `F.scaled_dot_product_attention`, `batch_first=True`
  throughout, LayerNorm, the output head tied to the token embedding), 5 steps on each
  transport, traced and compiled (`gg.compile` replays the fourth and fifth steps).

Each model trains twice from the same weights on the same inputs, once in plain torch and once
on the grid: the losses agree within a relative 1e-5 at every step, and so does every
parameter and buffer at the end. The inputs are sized so that float32 rounding alone cannot
move the results that much (a worker runs small ops on one intra-op thread, which rounds
differently): at 32x32 pixels and a batch of 2, resnet18's last stage normalizes 2 values
per channel, a gradient that is mostly rounding noise, where plain float32 torch differs from
float64 by 1%; at 64x64 the grid and torch agree bit for bit.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
import torchvision
from torch import nn

import gridgraph as gg

RTOL = 1e-5
# A bias feeding a batch norm in training (mobilenet's projection layers feed the next
# block's expansion) cancels out of the loss: its gradient is rounding noise, about 1e-10,
# which no relative tolerance can compare.
ATOL = 1e-7


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer, fetched from the workers."""
    return {
        name: t.get() if isinstance(t, gg.RemoteTensor) else t
        for name, t in model.state_dict(keep_vars=True).items()
    }


def assert_trains_alike(got: list[float], want: list[float], remote: nn.Module, local: nn.Module):
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert abs(g - w) <= RTOL * abs(w), f"step {step}: loss {g} on the grid, {w} in torch"
    got_state, want_state = state(remote), state(local)
    assert got_state.keys() == want_state.keys()
    for name, want_value in want_state.items():
        torch.testing.assert_close(
            got_state[name].detach(), want_value.detach(), rtol=RTOL, atol=ATOL, msg=name
        )


# --- torchvision -------------------------------------------------------------------------------


def classify(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int = 3) -> list[float]:
    """Loss per step of `steps` SGD steps of cross entropy, each recorded in `gg.trace()`."""
    opt = sgd(model)
    losses = []
    for _ in range(steps):
        with gg.trace():
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
        losses.append(loss.item())
    return losses


def resnet18() -> tuple[nn.Module, Callable]:
    model = torchvision.models.resnet18(weights=None, num_classes=10)
    return model, lambda m: [[m.conv1, m.bn1, m.layer1], [m.layer2, m.layer3], [m.layer4, m.fc]]


def mobilenet_v3_small() -> tuple[nn.Module, Callable]:
    # Its classifier's dropout would draw from the workers' generators, not torch's.
    model = torchvision.models.mobilenet_v3_small(weights=None, num_classes=10, dropout=0.0)
    return model, lambda m: [
        [m.features[:4]],
        [m.features[4:9]],
        [m.features[9:], m.classifier],
    ]


@pytest.mark.parametrize("build", [resnet18, mobilenet_v3_small])
def test_torchvision_model_split_over_three_workers_trains_as_in_torch(local_grid, build):
    torch.manual_seed(0)
    model, parts = build()
    remote = copy.deepcopy(model)
    x, y = torch.randn(2, 3, 64, 64), torch.randint(0, 10, (2,))
    want = classify(model, x, y)

    w0, w1, w2 = local_grid.workers
    for worker, modules in zip(local_grid.workers, parts(remote), strict=True):
        for module in modules:
            module.send(worker)
    assert {p.location for p in remote.parameters()} == {"w0", "w1", "w2"}
    got = classify(remote, x.send(w0), y.send(w2))

    assert_trains_alike(got, want, remote, model)


# --- a GPT-style decoder ----------------------------------------------------------------------


def mlp(width: int) -> nn.Module:
    return nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))


class MultiheadBlock(nn.Module):
    """Pre-norm decoder block; causal self-attention by `nn.MultiheadAttention`."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.mlp = mlp(width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        n = h.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(n)
        a = self.ln1(h)
        h = h + self.attn(a, a, a, attn_mask=mask, is_causal=True, need_weights=False)[0]
        return h + self.mlp(self.ln2(h))


class ScaledDotProductBlock(nn.Module):
    """Pre-norm decoder block; causal self-attention by `F.scaled_dot_product_attention`."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = mlp(width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, n, width = h.shape
        q, k, v = self.qkv(self.ln1(h)).split(width, dim=2)
        q, k, v = (t.view(b, n, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.out(a.transpose(1, 2).reshape(b, n, width))
        return h + self.mlp(self.ln2(h))


class GPT(nn.Module):
    def __init__(self, vocab: int = 40, context: int = 8, width: int = 32, heads: int = 4):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Embedding(context, width)
        self.blocks = nn.Sequential(
            MultiheadBlock(width, heads), ScaledDotProductBlock(width, heads)
        )
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied: one parameter, two uses

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1])
        h = self.embed(tokens) + self.position(positions)
        return self.head(self.ln(self.blocks(h)))


def language_model_step(model: nn.Module, opt: torch.optim.Optimizer) -> Callable:
    def step(tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        logits = model(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
        opt.step()
        return loss

    return step


def train_gpt(model: nn.Module, batches: list, compiled: bool) -> tuple[list[float], Callable]:
    """Loss per batch of SGD steps, each in `gg.trace()` or by `gg.compile`; and the step."""
    step = language_model_step(model, sgd(model))
    if compiled:
        step = gg.compile(step)
    losses = []
    for tokens, targets in batches:
        if compiled:
            loss = step(tokens, targets)
        else:
            with gg.trace():
                loss = step(tokens, targets)
        losses.append(loss.item())
    return losses, step


@pytest.mark.parametrize("compiled", [False, True], ids=["traced", "compiled"])
def test_gpt_decoder_with_tied_weights_trains_as_in_torch(grid, compiled):
    torch.manual_seed(1)
    model = GPT()
    remote = copy.deepcopy(model)
    assert remote.head.weight is remote.embed.weight
    text = torch.randint(0, 40, (5, 4, 9))  # 5 batches of 4 sequences of 8 tokens, and the next
    batches = [(t[:, :-1], t[:, 1:]) for t in text]
    want, _ = train_gpt(model, batches, compiled=False)

    w0, w1, w2 = grid.workers
    remote.embed.send(w0)
    remote.position.send(w0)
    remote.blocks[0].send(w1)
    remote.blocks[1].send(w2)
    remote.ln.send(w2)
    remote.head.send(w2)  # its weight is the embedding's: it keeps that pointer, on w0
    assert remote.head.weight is remote.embed.weight
    assert remote.head.weight.location == "w0"
    sent = [(tokens.send(w0), targets.send(w2)) for tokens, targets in batches]
    got, step = train_gpt(remote, sent, compiled)
    if compiled:  # SGD with momentum is steady from its third step: two replays
        assert (step.recordings, step.replays) == (3, 2)

    assert_trains_alike(got, want, remote, model)
