"""gradsync.SyncBatchNorm equals BatchNorm over all ranks' batches concatenated in one process: outputs, running
statistics and gradients, with uneven batch sizes, in eval mode, and under DDP with no_sync accumulation."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

import gradsync
from gradsync.testing import spawn

SIZES = {0: 3, 1: 5}  # samples per rank: uneven on purpose
C = 4


def _inputs(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 + step)
    total = sum(SIZES.values())
    return torch.randn(total, C, 3, 3, generator=g) * 2 + 1, torch.randn(total, C, 3, 3, generator=g)


def _slice(rank: int) -> slice:
    start = sum(SIZES[r] for r in range(rank))
    return slice(start, start + SIZES[rank])


def _sync_bn_steps(rank: int, world_size: int, momentum: float | None) -> dict:
    torch.manual_seed(0)
    bn = gradsync.SyncBatchNorm.convert_sync_batchnorm(nn.BatchNorm2d(C, momentum=momentum))
    assert isinstance(bn, gradsync.SyncBatchNorm)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)
    out = {}
    for step in range(2):
        x, g = _inputs(step)
        x = x[_slice(rank)].clone().requires_grad_(True)
        y = bn(x)
        (y * g[_slice(rank)]).sum().backward()  # a sum over samples: the ranks' losses add up to the global one
        out[f"y{step}"], out[f"dx{step}"] = y.detach(), x.grad
    out["dw"], out["db"] = bn.weight.grad, bn.bias.grad  # this rank's share; the global one is the sum
    out["running"] = (bn.running_mean.clone(), bn.running_var.clone(), int(bn.num_batches_tracked))
    bn.eval()
    out["eval"] = bn(_inputs(5)[0][_slice(rank)])
    return out


def _reference(momentum: float | None) -> dict:
    torch.manual_seed(0)
    bn = nn.BatchNorm2d(C, momentum=momentum)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)
    out = {}
    for step in range(2):
        x, g = _inputs(step)
        x = x.clone().requires_grad_(True)
        y = bn(x)
        (y * g).sum().backward()
        out[f"y{step}"], out[f"dx{step}"] = y.detach(), x.grad
    out["dw"], out["db"] = bn.weight.grad, bn.bias.grad
    out["running"] = (bn.running_mean.clone(), bn.running_var.clone(), int(bn.num_batches_tracked))
    bn.eval()
    out["eval"] = bn(_inputs(5)[0])
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("momentum", [0.1, None])
def test_sync_batchnorm_equals_batchnorm_on_the_global_batch(momentum: float | None) -> None:
    ranks = spawn(_sync_bn_steps, args=(momentum,), timeout=50)
    ref = _reference(momentum)
    close = dict(rtol=0, atol=1e-5)
    for rank, got in enumerate(ranks):
        for key in ("y0", "dx0", "y1", "dx1", "eval"):
            torch.testing.assert_close(got[key], ref[key][_slice(rank)], **close, msg=f"rank {rank} {key}")
        torch.testing.assert_close(got["running"][0], ref["running"][0], **close)
        torch.testing.assert_close(got["running"][1], ref["running"][1], **close)
        assert got["running"][2] == ref["running"][2]
    torch.testing.assert_close(ranks[0]["dw"] + ranks[1]["dw"], ref["dw"], **close)
    torch.testing.assert_close(ranks[0]["db"] + ranks[1]["db"], ref["db"], **close)


class ConvBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, C, 3, padding=1)
        self.bn = nn.BatchNorm2d(C)
        self.head = nn.Linear(C, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.bn(self.conv(x))).mean(dim=(2, 3)))


MICRO, PER_RANK = 2, 3


def _micro_batch(step: int, micro: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + micro)
    return torch.randn(world_size * PER_RANK, 2, 4, 4, generator=g), torch.randn(world_size * PER_RANK, 1, generator=g)


def _ddp_no_sync(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    model = gradsync.SyncBatchNorm.convert_sync_batchnorm(ConvBN())
    ddp = gradsync.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sl = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    for step in range(2):
        opt.zero_grad()
        for micro in range(MICRO):
            x, y = _micro_batch(step, micro, world_size)
            with ddp.no_sync() if micro < MICRO - 1 else contextlib.nullcontext():
                (nn.functional.mse_loss(ddp(x[sl]), y[sl]) / MICRO).backward()
        opt.step()
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.timeout(60)
def test_sync_batchnorm_under_ddp_with_no_sync_matches_one_process() -> None:
    ranks = spawn(_ddp_no_sync, timeout=50)
    torch.manual_seed(0)
    model = ConvBN()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        opt.zero_grad()
        for micro in range(MICRO):
            x, y = _micro_batch(step, micro, 2)
            (nn.functional.mse_loss(model(x), y) / MICRO).backward()
        opt.step()
    for got in ranks:
        for name, value in model.state_dict().items():
            torch.testing.assert_close(got[name].to(value.dtype), value, rtol=0, atol=1e-5, msg=name)


def _half_precision_steps(rank: int, world_size: int, dtype: torch.dtype) -> dict:
    """8 × 96 × 96 values per channel on each rank: 147,456 in all, past float16's largest count (65,504)."""
    torch.manual_seed(0)
    bn = gradsync.SyncBatchNorm(C)
    g = torch.Generator().manual_seed(rank)
    x = (torch.randn(8, C, 96, 96, generator=g) * 2 + 1).to(dtype).requires_grad_(True)
    y = bn(x)
    (y.float() * 1e-3).sum().backward()
    return {"y": y.detach(), "dx": x.grad, "running": (bn.running_mean, bn.running_var), "dw": bn.weight.grad}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_keeps_statistics_in_float32(dtype: torch.dtype) -> None:
    """As torch's SyncBatchNorm under autocast: output in the input's dtype, statistics and count in float32 (a
    float16 count was inf here, running_var NaN and the gradient's mean terms zero)."""
    ranks = spawn(_half_precision_steps, args=(dtype,), timeout=100)
    single = spawn(_half_precision_steps, args=(torch.float32,), timeout=100)
    for got, ref in zip(ranks, single):
        assert got["y"].dtype == dtype and got["dx"].dtype == dtype
        assert torch.isfinite(got["running"][1]).all() and got["running"][1].dtype == torch.float32
        tol = 1e-2 if dtype is torch.float16 else 6e-2  # the input's own rounding
        torch.testing.assert_close(got["y"].float(), ref["y"], rtol=0, atol=tol)
        torch.testing.assert_close(got["running"][1], ref["running"][1], rtol=tol, atol=tol)
        torch.testing.assert_close(got["dx"].float(), ref["dx"], rtol=0, atol=tol * 1e-3)
        torch.testing.assert_close(got["dw"], ref["dw"], rtol=tol, atol=tol)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_features": 0}, r"num_features .* must be an int >= 1, got int 0"),
        ({"num_features": 4, "eps": -1.0}, r"eps must be a number >= 0, got float -1.0"),
        ({"num_features": 4, "eps": 0.0}, r"eps must be > 0"),
        ({"num_features": 4, "momentum": float("nan")}, r"momentum must be a number >= 0, got float nan"),
        ({"num_features": 4, "momentum": 2.0}, r"momentum must be in \[0, 1\]"),
        ({"num_features": 4, "affine": "false"}, r"affine must be True or False, got str 'false'"),
    ],
)
def test_arguments_torchs_batchnorm_takes_unchecked_are_refused_by_name(kwargs: dict, message: str) -> None:
    """torch's BatchNorm accepts these and fails at the first forward, or never (a NaN momentum poisons the running
    statistics): refused at construction."""
    with pytest.raises(gradsync.errors.ConfigError, match=f"SyncBatchNorm: {message}"):
        gradsync.SyncBatchNorm(**kwargs)
