"""CUDA: buckets live on the parameters' device; NCCL with device_ids. Skipped without GPUs (none on CI here);
run them on a GPU machine."""

from __future__ import annotations

import pytest
import torch
from ddp_cases import BATCH, batch
from torch import nn

import gradsync
from gradsync.testing import spawn
from lab.zoo.toys import build

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def _train(rank: int, world_size: int, use_device_ids: bool) -> dict:
    device = torch.device("cuda", rank % torch.cuda.device_count())
    module = build("mlp").to(device)
    ddp = gradsync.DistributedDataParallel(
        module, device_ids=[device.index] if use_device_ids else None, bucket_cap_mb=0.0005
    )
    ref = build("mlp").to(device)
    ref_ddp = torch.nn.parallel.DistributedDataParallel(
        ref, device_ids=[device.index] if use_device_ids else None, bucket_cap_mb=0.0005
    )
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (module, ref)]
    for step in range(4):
        x, y = batch(step, 0, world_size)
        sl = slice(rank * BATCH, (rank + 1) * BATCH)
        for net, opt in zip((ddp, ref_ddp), opts):
            opt.zero_grad()
            nn.functional.mse_loss(net(x[sl].to(device)), y[sl].to(device)).backward()
            opt.step()
    assert all(b.buffer.device == device for b in ddp.reducer.buckets)
    return {
        "ours": {k: v.cpu() for k, v in module.state_dict().items()},
        "torch": {k: v.cpu() for k, v in ref.state_dict().items()},
    }


def _max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU")
@pytest.mark.timeout(120)
def test_cuda_tensors_over_gloo_match_torch() -> None:
    for res in spawn(_train, args=(False,), timeout=100):  # two ranks may share one GPU over gloo
        assert _max_diff(res["ours"], res["torch"]) <= 1e-5


@pytest.mark.skipif(GPUS < 2, reason="NCCL needs one GPU per rank: 2 GPUs")
@pytest.mark.timeout(120)
def test_nccl_with_device_ids_matches_torch() -> None:
    for res in spawn(_train, args=(True,), timeout=100, backend="nccl"):
        assert _max_diff(res["ours"], res["torch"]) <= 1e-5
