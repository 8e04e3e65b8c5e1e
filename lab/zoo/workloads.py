"""Benchmark models, each stressing one thing: big dense gradients (MLP), a transformer's mix of shapes, many
small BatchNorm parameters (CNN), and ~1,000 tiny parameters (per-hook Python overhead)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


class ResidualMLP(nn.Module):
    """~9.5M parameters: 9 residual blocks of 1024×1024 (the issue's figures use this one)."""

    def __init__(self, width: int = 1024, blocks: int = 9, inp: int = 256, out: int = 10) -> None:
        super().__init__()
        self.inp = nn.Linear(inp, width)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(blocks))
        self.out = nn.Linear(width, out)

    def forward(self, x):
        h = torch.relu(self.inp(x))
        for block in self.blocks:
            h = h + torch.relu(block(h))
        return self.out(h)


class LayerNormMLP(nn.Module):
    """~9.5M parameters: 8 pre-norm residual blocks of LayerNorm -> Linear(384, 1536) -> ReLU -> Linear(1536, 384),
    and a Linear(384, 10) head (the residual MLP of the reducer issue's tuner figures)."""

    def __init__(self, width: int = 384, hidden: int = 1536, blocks: int = 8, out: int = 10) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, hidden), nn.ReLU(), nn.Linear(hidden, width))
            for _ in range(blocks)
        )
        self.head = nn.Linear(width, out)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


class TinyGPT(nn.Module):
    """A small GPT-style decoder: 4 layers, d=256, 4 heads, vocabulary 512, context 64 (~3.5M parameters)."""

    def __init__(self, vocab: int = 512, d: int = 256, layers: int = 4, heads: int = 4, ctx: int = 64) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(ctx, d)
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
        self.layers = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(ctx), persistent=False)

    def forward(self, idx):
        t = idx.shape[1]
        h = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        h = self.layers(h, mask=self.mask[:t, :t], is_causal=True)
        return self.head(self.norm(h))


class BNConvNet(nn.Module):
    """A CNN with BatchNorm after every conv: many small parameters and buffers (~0.6M parameters)."""

    def __init__(self, channels: int = 64, depth: int = 8) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Conv2d(3, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU()]
        for _ in range(depth - 1):
            layers += [nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU()]
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(channels, 10)

    def forward(self, x):
        return self.head(self.body(x).mean(dim=(2, 3)))


class ManyTiny(nn.Module):
    """1,000 parameters of 16 values each, chained: the reducer's per-parameter cost dominates."""

    def __init__(self, n: int = 1000, width: int = 16) -> None:
        super().__init__()
        self.scales = nn.ParameterList(nn.Parameter(torch.ones(width)) for _ in range(n))

    def forward(self, x):
        for s in self.scales:
            x = x * s
        return x


def make(name: str) -> tuple[nn.Module, Callable]:
    """The model and a function ``batch(batch_size, generator) -> (input, loss_fn)``."""
    if name == "mlp":
        return ResidualMLP(), lambda b, g: (torch.randn(b, 256, generator=g), lambda out: out.pow(2).mean())
    if name == "lnmlp":
        return LayerNormMLP(), lambda b, g: (torch.randn(b, 384, generator=g), lambda out: out.pow(2).mean())
    if name == "gpt":
        return TinyGPT(), lambda b, g: (torch.randint(0, 512, (b, 64), generator=g), lambda out: out.pow(2).mean())
    if name == "cnn":
        return BNConvNet(), lambda b, g: (torch.randn(b, 3, 16, 16, generator=g), lambda out: out.pow(2).mean())
    if name == "tiny":
        return ManyTiny(), lambda b, g: (torch.randn(b, 16, generator=g), lambda out: out.pow(2).mean())
    raise ValueError(f"unknown model '{name}'; choose from {', '.join(MODELS)}")


MODELS = ("mlp", "lnmlp", "gpt", "cnn", "tiny")
