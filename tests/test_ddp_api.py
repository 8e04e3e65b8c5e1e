"""The drop-in surface: state dicts as torch's DDP gives them, plus unprefixed ones; forward that passes
everything through; evaluation that needs no peer."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

import gradsync
from gradsync.testing import spawn


def test_signature_matches_torch_positionally() -> None:
    ours = list(inspect.signature(gradsync.DistributedDataParallel.__init__).parameters)
    theirs = list(inspect.signature(torch.nn.parallel.DistributedDataParallel.__init__).parameters)
    assert ours[:13] == theirs[:13]  # self, module, device_ids, ..., static_graph


def _state(rank: int, world_size: int) -> dict:
    torch.manual_seed(rank)  # different init per rank: the constructor must broadcast rank 0's
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    model[1].running_mean.fill_(float(rank))
    ddp = gradsync.DistributedDataParallel(model)
    prefixed = sorted(ddp.state_dict())
    plain = ddp.module_state_dict()
    running_mean0 = plain["1.running_mean"].clone()
    fresh = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    fresh.load_state_dict(plain)
    ddp.load_module_state_dict(fresh.state_dict())
    ddp.load_state_dict(ddp.state_dict())
    if rank == 0:
        with torch.no_grad():  # evaluation on one rank alone must not wait for the others
            ddp.eval()
            ddp(torch.randn(2, 3))
            ddp.train()
    ddp(torch.randn(2, 3)).sum().backward()
    return {
        "prefixed": prefixed,
        "plain": sorted(plain),
        "weight": model[0].weight.detach().clone(),
        "running_mean0": running_mean0,
        "names": [n for n, _ in ddp.named_parameters()],
    }


@pytest.mark.timeout(60)
def test_state_dicts_and_initial_broadcast() -> None:
    r0, r1 = spawn(_state, timeout=50)
    assert r0["prefixed"] == sorted("module." + k for k in r0["plain"])
    assert "module.1.running_mean" in r0["prefixed"]
    assert r0["names"] == ["module.0.weight", "module.0.bias", "module.1.weight", "module.1.bias"]
    assert torch.equal(r0["running_mean0"], torch.zeros(4)) and torch.equal(r1["running_mean0"], torch.zeros(4))
    assert torch.equal(r0["weight"], r1["weight"])  # rank 1 now holds rank 0's initial weights (after one step)
