"""Deterministic batches and the checks the cases share (their models are lab/zoo/toys.py's ``Shallow*`` and ``Big``).

Rank functions (run by ``gradsync.testing.spawn``) must be module-level; the training helpers here run inside them
and return plain lists, so results pickle and checks can compare ranks and a single-process reference.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lab.zoo.toys import IN


def batch(step: int, rank: int, n: int = 4, d: int = IN, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, d, generator=g).to(dtype)


def loss_of(out: Any) -> torch.Tensor:
    return out.pow(2).mean()


def max_diff(xs: list[float], ys: list[float]) -> float:
    """Largest difference, NaN-aware: NaN against NaN is equal, NaN against a number is infinitely far."""
    if len(xs) != len(ys):
        return float("inf")
    worst = 0.0
    for a, b in zip(xs, ys):
        if a != a or b != b:
            if not (a != a and b != b):
                return float("inf")
            continue
        worst = max(worst, abs(a - b))
    return worst


def flat(module: nn.Module) -> list[float]:
    return torch.cat([p.detach().double().flatten() for p in module.parameters()]).tolist()


def flat_buffers(module: nn.Module) -> list[float]:
    bufs = [b.detach().double().flatten() for b in module.buffers()]
    return torch.cat(bufs).tolist() if bufs else []


def train_compare(
    ddp: Any,
    ref: nn.Module,
    rank: int,
    world: int,
    steps: int = 3,
    make: Callable[[int, int], Any] = batch,
    lr: float = 0.1,
    optimizer: Any = None,
) -> dict[str, Any]:
    """Train ``ddp`` for ``steps`` steps on this rank's batches, and ``ref`` (a plain copy with the same starting
    weights) on every rank's batches with the averaged loss: DDP must match it. Returns this rank's parameters and
    the largest difference from the reference."""
    opt = optimizer or torch.optim.SGD(ddp.parameters(), lr=lr)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=lr)
    for step in range(steps):
        opt.zero_grad()
        loss_of(ddp(make(step, rank))).backward()
        opt.step()
        ref_opt.zero_grad()
        (sum(loss_of(ref(make(step, r))) for r in range(world)) / world).backward()
        ref_opt.step()
    ddp.eval()
    with torch.no_grad():  # the forward after a synced one broadcasts rank 0's buffers; eval does not change them
        ddp(make(0, rank))
    ddp.train()
    mine, theirs = flat(ddp.module), flat(ref)
    diff = max_diff(mine, theirs)
    return {"params": mine, "ref_diff": diff, "buffers": flat_buffers(ddp.module)}


def seeded(make: Callable[[], nn.Module], seed: int = 0) -> tuple[nn.Module, nn.Module]:
    """A model built from ``seed`` and a plain copy made before any wrapper touches it."""
    torch.manual_seed(seed)
    model = make()
    return model, copy.deepcopy(model)


def same_and_right(results: list[dict[str, Any]], tol: float = 1e-5) -> str | None:
    """Check for :func:`train_compare` results: replicas identical, and equal to the single-process reference."""
    problem = replicas_equal(results)
    if problem:
        return problem
    for rank, r in enumerate(results):
        if r["ref_diff"] > tol:
            return f"wrong numbers: rank {rank} is {r['ref_diff']:.3g} from single-process training on all batches"
    bufs = [r.get("buffers") for r in results]
    if any(max_diff(b or [], bufs[0] or []) > 1e-6 for b in bufs):
        return "replicas' buffers differ"
    return None


def replicas_equal(results: list[dict[str, Any]]) -> str | None:
    """Check: every rank ends with the same parameters (no reference to compare with)."""
    if not results or any(r is None for r in results):
        return f"missing results: {results!r:.200}"
    first = results[0]["params"]
    for rank, r in enumerate(results[1:], start=1):
        diff = max_diff(first, r["params"])
        if diff > 1e-6:
            return f"replicas differ: rank {rank}'s parameters are {diff:.3g} from rank 0's"
    return None


def setenv(**values: str | None) -> None:
    """Set (or, with None, unset) environment variables in this process."""
    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
