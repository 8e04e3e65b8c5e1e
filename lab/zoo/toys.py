"""Small models that each stress one thing the reducer must get right. Built from a seed, so every rank and the
single-process reference start from identical weights."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

IN, OUT = 6, 3


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(IN, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, OUT))

    def forward(self, x, **_):
        return self.net(x)


class Tied(nn.Module):
    """One Linear applied twice, an output layer sharing the input layer's weight, and a frozen layer."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(IN, 16, bias=False)
        self.shared = nn.Linear(16, 16)
        self.frozen = nn.Linear(16, 16)
        self.frozen.requires_grad_(False)
        self.out = nn.Linear(16, IN, bias=False)
        self.out.weight = self.inp.weight  # (16, IN) used as (IN <- 16) via transpose below
        self.head = nn.Linear(IN, OUT)

    def forward(self, x, **_):
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.shared(torch.tanh(self.shared(h))))
        h = self.frozen(h)
        return self.head(h @ self.inp.weight)


class BN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(IN, 16)
        self.bn = nn.BatchNorm1d(16)
        self.head = nn.Linear(16, OUT)

    def forward(self, x, **_):
        return self.head(torch.relu(self.bn(self.fc(x))))


class SometimesUsed(nn.Module):
    """``extra`` is used only where the caller says so (rank-dependent); ``never`` is used by nobody."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(IN, 16)
        self.extra = nn.Linear(16, 16)
        self.never = nn.Linear(16, 16)
        self.head = nn.Linear(16, OUT)

    def forward(self, x, use_extra: bool = True):
        h = torch.tanh(self.body(x))
        if use_extra:
            h = torch.tanh(self.extra(h))
        return self.head(h)


@dataclasses.dataclass
class Aux:
    value: torch.Tensor
    note: str = "kept"


class Nested(nn.Module):
    """Returns tensors inside a dict, a list, a tuple and a dataclass."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(IN, OUT)
        self.b = nn.Linear(IN, OUT)
        self.c = nn.Linear(IN, OUT)

    def forward(self, x, **_):
        return {"logits": self.a(x), "aux": [self.b(x), (Aux(self.c(x)),)]}


def nested_loss(out, y):
    assert isinstance(out, dict) and isinstance(out["aux"], list) and isinstance(out["aux"][1], tuple)
    assert isinstance(out["aux"][1][0], Aux) and out["aux"][1][0].note == "kept"
    pred = out["logits"] + 0.5 * out["aux"][0] + 0.25 * out["aux"][1][0].value
    return nn.functional.mse_loss(pred, y)


# The bad-input sweep's models (conformance/sweep/): one hidden layer whose width a case can change, so that a
# model differing between ranks is one argument away, and one large enough for the bucket tuner to probe.


class Shallow(nn.Module):
    def __init__(self, hidden: int = 8) -> None:
        super().__init__()
        self.fc1 = nn.Linear(IN, hidden)
        self.fc2 = nn.Linear(hidden, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


class ShallowBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(IN, 8)
        self.bn = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.bn(self.fc(x))))


class ShallowWithBuffer(Shallow):
    """A Shallow with a buffer the caller describes (shape, dtype), or none."""

    def __init__(self, shape: tuple[int, ...] | None = (3,), dtype: torch.dtype = torch.float32, extra: bool = False):
        super().__init__()
        if shape is not None:
            self.register_buffer("stat", torch.zeros(shape, dtype=dtype))
        if extra:
            self.register_buffer("extra", torch.ones(2))


class Big(nn.Module):
    """Gradients of 0.5 MiB: large enough for the bucket-size tuner to probe."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(256, 256)
        self.b = nn.Linear(256, 256)
        self.head = nn.Linear(256, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.b(torch.tanh(self.a(x)))))


MODELS = {"mlp": MLP, "tied": Tied, "bn": BN, "sometimes": SometimesUsed, "nested": Nested}


def build(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return MODELS[name]()


def loss_fn(name: str):
    return nested_loss if name == "nested" else nn.functional.mse_loss
