"""The two-level all-reduce hook (gradsync/comm/hierarchical.py): 4 gloo ranks told they are 2 hosts of 2, training
equal to torch's DDP with its default all-reduce; the groups it makes, and where it falls back to a flat one."""

from __future__ import annotations

import torch
from torch import nn

import gradsync
from gradsync.comm.hierarchical import HierarchicalState, hierarchical_hook, hosts_of
from gradsync.testing import spawn


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 33), nn.Tanh(), nn.Linear(33, 5))  # odd sizes: chunks padded to 2 ranks


def _train(rank: int, world: int, hosts: int, bucket_cap_mb: float, piece_bytes: int = 2**20) -> dict:
    torch.set_num_threads(1)
    state = HierarchicalState(host=f"host{rank * hosts // world}", piece_bytes=piece_bytes)
    results = {}
    for name in ("torch", "gradsync"):
        wrap = torch.nn.parallel.DistributedDataParallel if name == "torch" else gradsync.DistributedDataParallel
        model = wrap(_model(), bucket_cap_mb=bucket_cap_mb)
        if name == "gradsync":
            model.register_comm_hook(state, hierarchical_hook)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(4):
            g = torch.Generator().manual_seed(100 * step + rank)
            optimizer.zero_grad()
            model(torch.randn(6, 7, generator=g)).pow(2).mean().backward()
            optimizer.step()
        results[name] = [p.detach().clone() for p in model.parameters()]
    return {
        "diff": max((a - b).abs().max().item() for a, b in zip(results["torch"], results["gradsync"])),
        "flat_because": state.flat_because,
        "hosts": state.hosts,
        "split": state.local is not None and state.across is not None,
    }


def test_two_hosts_of_two_ranks_train_as_torchs_flat_all_reduce() -> None:
    # One bucket in one piece; several buckets (of odd sizes: padded); pieces of 16 values pipelined through the steps.
    for cap, piece_bytes in ((25.0, 2**20), (0.0005, 2**20), (25.0, 64), (0.0005, 64)):
        results = spawn(_train, world_size=4, args=(2, cap, piece_bytes), timeout=120, pg_timeout=30)
        for rank, r in enumerate(results):
            assert r["diff"] <= 1e-6, (rank, cap, r)
            assert r["flat_because"] == "" and r["split"] and r["hosts"] == [[0, 1], [2, 3]], r


def test_one_host_or_one_rank_a_host_is_a_flat_all_reduce_saying_why() -> None:
    one_host = spawn(_train, world_size=2, args=(1, 25.0), timeout=60)[0]
    assert one_host["flat_because"] == "one host" and not one_host["split"] and one_host["diff"] <= 1e-6
    per_rank = spawn(_train, world_size=2, args=(2, 25.0), timeout=60)[0]
    assert per_rank["flat_because"] == "one rank a host" and per_rank["diff"] <= 1e-6


def test_hosts_are_listed_in_order_of_their_lowest_rank() -> None:
    assert hosts_of(["b", "a", "b", "a"]) == [[0, 2], [1, 3]]
    assert hosts_of(["x", "x", "y"]) == [[0, 1], [2]]


def test_a_piece_of_no_bytes_and_an_empty_host_are_refused_by_name(group_of_one: None) -> None:
    """piece_bytes=0 was accepted, and the first backward over two hosts never finished (pieces of no bytes)."""
    import pytest

    from gradsync.errors import ConfigError

    with pytest.raises(ConfigError, match=r"HierarchicalState: piece_bytes .* must be an int >= 1, got int 0"):
        HierarchicalState(piece_bytes=0)
    with pytest.raises(ConfigError, match="HierarchicalState: host must name this rank's host"):
        HierarchicalState(host="")
    with pytest.raises(ConfigError, match="HierarchicalState: process_group must be a torch.distributed.ProcessGroup"):
        HierarchicalState("gloo")  # type: ignore[arg-type]
