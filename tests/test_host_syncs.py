"""Host syncs in the hot path, counted: a steady synced step must not read a tensor's value on the host more often
than its mode needs (on a GPU each read waits for the device). CPU cannot see a sync, so the reads that would be one
(``item``, ``tolist``, ``bool``, ``float``, ``int``, ``cpu``, ``numpy``) are counted instead; a new one fails here."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradsync
from gradsync.testing import spawn

READS = ("item", "tolist", "__bool__", "__float__", "__int__", "cpu", "numpy")
# What each mode reads per steady step, and why: find_unused_parameters reads the all-reduced usage map on the host
# only when this rank left a parameter unused, to decide which .grad to leave untouched (torch's reducer reads it
# lazily, in the same case); a rank that used every parameter knows they are used everywhere.
EXPECTED = {"default": 0, "bucket_view": 0, "static_graph": 0, "find_unused": 0, "find_unused_some_unused": 1}
MODES = {
    "default": {},
    "bucket_view": {"gradient_as_bucket_view": True},
    "static_graph": {"static_graph": True},
    "find_unused": {"find_unused_parameters": True},
    "find_unused_some_unused": {"find_unused_parameters": True},
}


class _OneUnused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
        self.unused = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _reads_per_step(rank: int, world: int, mode: str) -> float:
    torch.manual_seed(0)
    model = _OneUnused() if mode == "find_unused_some_unused" else nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
    ddp = gradsync.DistributedDataParallel(model, bucket_cap_mb=0.02, **MODES[mode])
    x = torch.randn(8, 64)
    for _ in range(8):  # past the rebuild (and any tuner trial)
        ddp(x).sum().backward()
    counts = {name: 0 for name in READS}
    real = {name: getattr(torch.Tensor, name) for name in READS}

    def counting(name: str):  # type: ignore[no-untyped-def]
        def read(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            counts[name] += 1
            return real[name](self, *args, **kwargs)

        return read

    for name in READS:
        setattr(torch.Tensor, name, counting(name))
    try:
        for _ in range(4):
            out = ddp(x)
            loss = out.sum()
            loss.backward()
    finally:
        for name in READS:
            setattr(torch.Tensor, name, real[name])
    return sum(counts.values()) / 4


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", sorted(MODES))
def test_host_reads_per_steady_step(mode: str) -> None:
    reads = spawn(_reads_per_step, 2, args=(mode,), timeout=100)
    assert reads == [EXPECTED[mode]] * 2, f"{mode}: {reads} host reads per step, expected {EXPECTED[mode]}"
