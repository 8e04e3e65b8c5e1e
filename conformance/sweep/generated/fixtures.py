"""What the generated cases build their valid baseline calls from: a process group of one, a small model, a
gradsync DDP around it, datasets, and the short use (a training step, an epoch) that shows whether a value that was
accepted works."""

from __future__ import annotations

import copy
import os
from typing import Any

import torch
from torch import nn

from conformance.sweep.core import group1

IN, OUT = 4, 2


def model(seed: int = 0, width: int = 8) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, width), nn.ReLU(), nn.Linear(width, OUT))


def ddp(seed: int = 0, width: int = 8, **kwargs: Any) -> Any:
    import gradsync

    group1()
    return gradsync.DistributedDataParallel(model(seed, width), **kwargs)


def batch(step: int = 0) -> torch.Tensor:
    return torch.randn(4, IN, generator=torch.Generator().manual_seed(step))


def train(module: Any, optimizer: Any = None, steps: int = 2) -> None:
    """``steps`` forward, backward and optimizer steps of ``module``; raises what they raise."""
    opt = optimizer if optimizer is not None else torch.optim.SGD(module.parameters(), lr=0.1)
    for step in range(steps):
        opt.zero_grad()
        module(batch(step)).pow(2).mean().backward()
        opt.step()


def iterate(sampler: Any) -> list[Any]:
    return list(iter(sampler))


DATASET = list(range(10))
TOKENS = [list(range(n)) for n in (3, 9, 1, 7, 5, 2, 8, 4, 6, 10)]  # sequences of these lengths


def hf_rows() -> list[dict[str, Any]]:
    """Rows as a Hugging Face dataset gives them: a dict of equally long sequences per example."""
    return [{"input_ids": t, "attention_mask": [1] * len(t)} for t in TOKENS]


def ambiguous_rows() -> list[dict[str, Any]]:
    """Dict rows with two sequences of different lengths and no ``input_ids``: which one is the length?"""
    return [{"question": t, "answer": t[: max(1, len(t) // 2)]} for t in TOKENS]


def world1_env(port: int) -> None:
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def state_after_training(make: Any, **kwargs: Any) -> dict[str, Any]:
    """``make(...)``'s state_dict after a step (an optimizer's state exists only once it stepped)."""
    obj = make(**kwargs)
    return copy.deepcopy(obj.state_dict())
