"""One rank of ``python -m bench.mixed_precision``: the variants, the task, and the three measurements."""

from __future__ import annotations

import contextlib
import resource
import statistics
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

import gradsync
from bench.interleave import time_interleaved
from lab.zoo.workloads import TinyGPT

VARIANTS = ("fp32", "autocast", "mixed")
VOCAB, CONTEXT, BATCH = 512, 64, 8


def build(variant: str, seed: int) -> tuple[nn.Module, torch.optim.Optimizer, Callable]:
    """The DDP model, its AdamW, and the context its forward runs in."""
    torch.manual_seed(seed)
    policy = gradsync.MixedPrecision(torch.bfloat16, reduce_dtype=torch.float32) if variant == "mixed" else None
    model = gradsync.DistributedDataParallel(TinyGPT(VOCAB, ctx=CONTEXT), mixed_precision=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    if variant == "autocast":
        return model, optimizer, lambda: torch.autocast("cpu", dtype=torch.bfloat16)
    return model, optimizer, contextlib.nullcontext


def batch(rank: int, step: int, seed: int) -> torch.Tensor:
    """Sequences where each token is followed by one of two tokens (5x+3 or 5x+4 mod the vocabulary), at random:
    learnable, with a floor of ln 2 nats."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 101 + rank)
    tokens = torch.empty(BATCH, CONTEXT, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, VOCAB, (BATCH,), generator=g)
    coin = torch.randint(0, 2, (BATCH, CONTEXT), generator=g)
    for i in range(1, CONTEXT):
        tokens[:, i] = (5 * tokens[:, i - 1] + 3 + coin[:, i]) % VOCAB
    return tokens


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, context: Callable, idx: torch.Tensor) -> float:
    optimizer.zero_grad(set_to_none=True)
    with context():
        logits = model(idx)
    loss = nn.functional.cross_entropy(logits[:, :-1].float().flatten(0, 1), idx[:, 1:].flatten())
    loss.backward()
    optimizer.step()
    return loss.item()


def rank_times(rank: int, world: int, timed: int) -> dict:
    """Each variant's median step (ms, the slowest rank's), its median ratio to fp32's step of the same round, and the
    cores the ranks kept busy."""
    built = {v: build(v, 0) for v in VARIANTS}
    idx = batch(rank, 0, 0)
    steps = {v: (lambda v=v: train_step(*built[v], idx)) for v in VARIANTS}  # type: ignore[misc]
    times, busy = time_interleaved(steps, warmup=3, count=timed)
    return {
        "ms": {v: 1e3 * statistics.median(ts) for v, ts in times.items()},
        "ratio": {v: statistics.median(a / b for a, b in zip(times[v], times["fp32"])) for v in VARIANTS},
        "busy": busy,
    }


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rank_memory(rank: int, world: int, variant: str) -> float:
    """How much this rank's peak resident memory grew from before the model was built to after 3 steps (MiB)."""
    idx = batch(rank, 0, 0)
    dist.barrier()
    before = _peak_mib()
    built = build(variant, 0)
    for _ in range(3):
        train_step(*built, idx)
    return _peak_mib() - before


def rank_losses(rank: int, world: int, steps: int, run: int) -> dict[str, float]:
    """The mean of the last 10 steps' losses (averaged over the ranks) of each variant trained from seed ``run``, and
    of fp32 from another seed (``fp32-seed2``: the noise between two fp32 runs)."""
    out = {}
    for name, variant, seed in [*((v, v, run) for v in VARIANTS), ("fp32-seed2", "fp32", run + 100)]:
        built = build(variant, seed)
        losses = [train_step(*built, batch(rank, step, seed)) for step in range(steps)]
        last = torch.tensor([statistics.fmean(losses[-10:])], dtype=torch.float64)
        dist.all_reduce(last)
        out[name] = last.item() / world
    return out
