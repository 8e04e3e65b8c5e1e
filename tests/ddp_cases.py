"""One training recipe run four ways: gradsync DDP, torch's DDP and the naive reducer on N ranks, and a
single-process reference that sees every rank's batch. Tests compare the resulting states."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import torch
from torch import nn

import gradsync
from gradsync.collectives import Communicator, Op, broadcast_tensors
from gradsync.reducer.naive import average_gradients
from lab.zoo.toys import IN, OUT, build, loss_fn

BATCH = 4  # per rank


@dataclasses.dataclass(frozen=True)
class Case:
    model: str = "mlp"
    optimizer: str = "sgd"
    steps: int = 4
    micro: int = 1  # micro-batches per step (gradient accumulation)
    idiom: str = "no_sync"  # or "attr": set require_backward_grad_sync directly, as nanoGPT does
    ddp_kwargs: tuple = ()  # (name, value) pairs
    extra_on_rank0_only: bool = False  # SometimesUsed: rank 0 uses `extra`, the others do not
    whole_batch_reference: bool = False  # reference runs the concatenated batch in one forward
    with_torch: bool = True

    @property
    def kwargs(self) -> dict[str, Any]:
        return dict(self.ddp_kwargs)


def make_optimizer(params, kind: str) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.Adam(params, lr=0.01)


def batch(step: int, micro: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randn(world_size * BATCH, IN, generator=g), torch.randn(world_size * BATCH, OUT, generator=g)


def forward_kwargs(case: Case, rank: int) -> dict[str, Any]:
    return {"use_extra": rank == 0} if case.extra_on_rank0_only else {}


def _train_distributed(case: Case, rank: int, world_size: int, wrap) -> tuple[nn.Module, list[str]]:
    """``wrap(module) -> (callable model, ddp-or-None)``; ddp None means the naive reducer."""
    module = build(case.model)
    model, ddp = wrap(module)
    opt = make_optimizer([p for p in module.parameters() if p.requires_grad], case.optimizer)
    lossf = loss_fn(case.model)
    for step in range(case.steps):
        opt.zero_grad(set_to_none=True)
        for m in range(case.micro):
            last = m == case.micro - 1
            x, y = batch(step, m, world_size)
            xr, yr = x[rank * BATCH : (rank + 1) * BATCH], y[rank * BATCH : (rank + 1) * BATCH]
            ctx = contextlib.nullcontext()
            if ddp is not None and case.idiom == "no_sync" and not last:
                ctx = ddp.no_sync()
            elif ddp is not None:
                ddp.require_backward_grad_sync = last
            if ddp is None and last:
                broadcast_tensors(Communicator(), Op.BUFFER_BROADCAST, list(module.buffers()))
            with ctx:
                loss = lossf(model(xr, **forward_kwargs(case, rank)), yr) / case.micro
                loss.backward()
        if ddp is None:
            average_gradients(module.parameters())
        opt.step()
    no_grad = [n for n, p in module.named_parameters() if p.requires_grad and p.grad is None]
    return module, no_grad


def run_case(rank: int, world_size: int, case: Case) -> dict[str, Any]:
    """Worker: train with each implementation; return their states and which params ended without .grad."""
    out: dict[str, Any] = {}

    def ours(m):
        ddp = gradsync.DistributedDataParallel(m, **case.kwargs)
        return ddp, ddp

    def theirs(m):
        ddp = torch.nn.parallel.DistributedDataParallel(m, **case.kwargs)
        return ddp, ddp

    def naive(m):
        broadcast_tensors(
            Communicator(), Op.INITIAL_BROADCAST, [p.detach() for p in m.parameters()] + list(m.buffers())
        )
        return m, None

    variants = {"gradsync": ours, "naive": naive}
    if case.with_torch:
        variants["torch"] = theirs
    for name, wrap in variants.items():
        module, no_grad = _train_distributed(case, rank, world_size, wrap)
        out[name] = {k: v.detach().clone() for k, v in module.state_dict().items()}
        out[name + "_no_grad"] = no_grad
    return out


def reference(case: Case, world_size: int) -> dict[str, torch.Tensor]:
    """One process, every rank's batch. Per-shard forwards reproduce per-rank BatchNorm statistics and
    rank-dependent branches; buffers follow rank 0, which DDP broadcasts before each synced forward."""
    module = build(case.model)
    opt = make_optimizer([p for p in module.parameters() if p.requires_grad], case.optimizer)
    lossf = loss_fn(case.model)
    for step in range(case.steps):
        opt.zero_grad(set_to_none=True)
        for m in range(case.micro):
            x, y = batch(step, m, world_size)
            if case.whole_batch_reference:
                loss = lossf(module(x), y)
            else:
                start = [b.clone() for b in module.buffers()]
                losses, after_rank0 = [], None
                for r in range(world_size):
                    _set_buffers(module, start)
                    sl = slice(r * BATCH, (r + 1) * BATCH)
                    losses.append(lossf(module(x[sl], **forward_kwargs(case, r)), y[sl]))
                    if r == 0:
                        after_rank0 = [b.clone() for b in module.buffers()]
                _set_buffers(module, after_rank0)
                loss = sum(losses) / world_size
            (loss / case.micro).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _set_buffers(module: nn.Module, values: list[torch.Tensor]) -> None:
    # Rebind instead of copy_: BatchNorm's backward saved the old buffers and checks their version.
    for (name, _), value in zip(module.named_buffers(), values):
        owner, _, attr = name.rpartition(".")
        module.get_submodule(owner)._buffers[attr] = value.clone()


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], params_only_of: nn.Module | None = None) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    keys = a.keys()
    if params_only_of is not None:
        keys = [k for k, _ in params_only_of.named_parameters()]
    return max((a[k].double() - b[k].double()).abs().max().item() for k in keys)
