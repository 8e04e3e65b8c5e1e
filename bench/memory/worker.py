"""One rank of ``python -m bench.memory`` (started by ``gradsync.testing.spawn``, which imports it by name: a rank
function in ``__main__`` could not be found by the spawned ranks)."""

from __future__ import annotations

import resource

import torch
from torch import nn

import gradsync


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _model(million: int) -> nn.Module:
    width = 2048
    layers = max(1, round(million * 1e6 / (width * width + width)))
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def rank_memory(rank: int, world: int, impl: str, million: int, steps: int) -> dict[str, float]:
    """One rank: MiB its peak resident memory grew by from the built model, at construction and after ``steps``."""
    torch.manual_seed(0)
    model = _model(million)
    x = torch.randn(4, 2048)
    base = _peak_mib()
    ddp_class = gradsync.DistributedDataParallel if impl == "gradsync" else nn.parallel.DistributedDataParallel
    ddp = ddp_class(model)
    built = _peak_mib()
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    for _ in range(steps):
        opt.zero_grad(set_to_none=False)  # gradients stay allocated, as in most loops' steady state
        ddp(x).sum().backward()
        opt.step()
    trained = _peak_mib()
    params = sum(p.numel() for p in model.parameters())
    return {"construction": built - base, "after_steps": trained - base, "params_mib": params * 4 / 2**20}
