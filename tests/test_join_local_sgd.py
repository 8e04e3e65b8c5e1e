"""Skipping and uneven inputs: join() with 3 vs 5 batches finishes and matches a reference; post-local SGD keeps
replicas identical right after each averaging and averages exactly."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
from ddp_cases import BATCH, batch
from torch import nn

import gradsync
from gradsync.comm import PostLocalSGD
from gradsync.testing import spawn
from lab.zoo.toys import build

STEPS = {0: 3, 1: 5}


def _join(
    rank: int, world_size: int, divide_by_initial: bool, with_bn: bool, steps=STEPS, cap=0.0005, static=False
) -> dict:
    module = build("bn" if with_bn else "mlp")
    ddp = gradsync.DistributedDataParallel(module, bucket_cap_mb=cap, static_graph=static)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    with ddp.join(divide_by_initial_world_size=divide_by_initial):
        for step in range(steps[rank]):
            x, y = batch(step, 0, world_size)
            sl = slice(rank * BATCH, (rank + 1) * BATCH)
            opt.zero_grad()
            nn.functional.mse_loss(ddp(x[sl]), y[sl]).backward()
            opt.step()
    return {k: v.clone() for k, v in module.named_parameters()}


def _join_reference(world_size: int, divide_by_initial: bool, steps=STEPS, micro: int = 1) -> dict:
    """One process: each step, the active ranks' losses over ``micro`` micro-batches, averaged as join() does."""
    module = build("mlp")
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    for step in range(max(steps.values())):
        active = [r for r in range(world_size) if steps[r] > step]
        opt.zero_grad()
        for m in range(micro):
            x, y = batch(step, m, world_size)
            losses = [
                nn.functional.mse_loss(module(x[r * BATCH : (r + 1) * BATCH]), y[r * BATCH : (r + 1) * BATCH])
                for r in active
            ]
            (sum(losses) / (world_size if divide_by_initial else len(active))).backward()
        opt.step()
    return {k: v.clone() for k, v in module.named_parameters()}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("divide_by_initial", [True, False])
def test_join_with_uneven_inputs_matches_reference(divide_by_initial: bool) -> None:
    r0, r1 = spawn(_join, args=(divide_by_initial, False), timeout=80, pg_timeout=20)
    ref = _join_reference(2, divide_by_initial)
    for k in ref:
        assert torch.equal(r0[k], r1[k]), k  # everyone ends with the last joiner's model
        assert (r0[k] - ref[k]).abs().max() <= 1e-5, k


@pytest.mark.timeout(90)
@pytest.mark.parametrize("first,static", [(1, False), (0, False), (0, True)])
def test_join_before_the_rebuild_shadows_the_rebuild_and_bucket_tuning(first: int, static: bool) -> None:
    # Rank 0 joins after one batch (or none): the rebuild, the tuner's link probe and the plan broadcast happen at
    # rank 1's second forward, so rank 0's join hook must take part in each of them.
    steps = {0: first, 1: 3}
    r0, r1 = spawn(_join, args=(True, False, steps, "auto", static), timeout=80, pg_timeout=20)
    ref = _join_reference(2, True, steps)
    for k in ref:
        assert torch.equal(r0[k], r1[k]), k
        assert (r0[k] - ref[k]).abs().max() <= 1e-5, k


@pytest.mark.timeout(90)
def test_join_shadows_buffer_broadcasts() -> None:
    r0, r1 = spawn(_join, args=(True, True), timeout=80, pg_timeout=20)  # BatchNorm: buffers broadcast each step
    assert all(torch.equal(r0[k], r1[k]) for k in r0)


def _local_sgd(rank: int, world_size: int) -> list[dict]:
    module = build("mlp")
    ddp = gradsync.DistributedDataParallel(module)
    local = PostLocalSGD(ddp, period=3, warmup_steps=2)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    log = []
    for step in range(9):
        x, y = batch(step, 0, world_size)
        sl = slice(rank * BATCH, (rank + 1) * BATCH)
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x[sl]), y[sl]).backward()
        opt.step()
        before = [p.detach().clone() for p in module.parameters()]
        averaged = local.step()
        log.append({"averaged": averaged, "before": before, "after": [p.detach().clone() for p in module.parameters()]})
    return log


@pytest.mark.timeout(90)
def test_post_local_sgd_averages_every_period_after_warmup() -> None:
    log0, log1 = spawn(_local_sgd, timeout=80)
    assert [e["averaged"] for e in log0] == [False, False, False, False, True, False, False, True, False]
    for step, (a, b) in enumerate(zip(log0, log1)):
        same = all(torch.equal(p, q) for p, q in zip(a["after"], b["after"]))
        assert same == (step < 2 or a["averaged"]), step  # synced in warm-up and right after each averaging
        if a["averaged"]:
            for p, q, after in zip(a["before"], b["before"], a["after"]):
                assert (after - (p + q) / 2).abs().max() <= 1e-6


ACCUM_STEPS = {0: 2, 1: 4}


def _join_accumulating(rank: int, world_size: int) -> dict:
    # no_sync inside join(): the no_sync micro-batches run no collective, so the joined rank only shadows the
    # synced ones, and the averages still count only the active ranks' accumulated gradients.
    module = build("mlp")
    ddp = gradsync.DistributedDataParallel(module, bucket_cap_mb=0.0005)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    sl = slice(rank * BATCH, (rank + 1) * BATCH)
    with ddp.join():
        for step in range(ACCUM_STEPS[rank]):
            opt.zero_grad()
            for micro in range(2):
                x, y = batch(step, micro, world_size)
                with ddp.no_sync() if micro == 0 else contextlib.nullcontext():
                    nn.functional.mse_loss(ddp(x[sl]), y[sl]).backward()
            opt.step()
    return {k: v.clone() for k, v in module.named_parameters()}


@pytest.mark.timeout(90)
def test_no_sync_accumulation_inside_join_matches_reference() -> None:
    r0, r1 = spawn(_join_accumulating, timeout=80, pg_timeout=20)
    ref = _join_reference(2, True, ACCUM_STEPS, micro=2)  # divided by the initial world size
    for k in ref:
        assert torch.equal(r0[k], r1[k]), k
        assert (r0[k] - ref[k]).abs().max() <= 1e-5, k


UNEVEN = {0: 3, 1: 6, 2: 4}
MODES = {"plain": {}, "find_unused": {"find_unused_parameters": True}, "static": {"static_graph": True}}


def _join_modes(rank: int, world_size: int, mode: str, debug: bool) -> dict:
    # GRADSYNC_DEBUG fingerprints every collective; a joined rank shadows the others through the same code, so
    # its fingerprints match theirs and the debug run trains exactly as the plain one.
    os.environ["GRADSYNC_DEBUG"] = "1" if debug else "0"
    module = build("bn")  # Linear - BatchNorm1d - Linear: buffers are broadcast before each synced forward
    ddp = gradsync.DistributedDataParallel(module, bucket_cap_mb=0.0005, **MODES[mode])
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    sl = slice(rank * BATCH, (rank + 1) * BATCH)
    with ddp.join():
        for step in range(UNEVEN[rank]):
            x, y = batch(step, 0, world_size)
            opt.zero_grad()
            nn.functional.mse_loss(ddp(x[sl]), y[sl]).backward()
            opt.step()
    return {k: v.clone() for k, v in module.state_dict().items()}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_join_under_debug_equals_join_without(world_size: int, mode: str) -> None:
    plain = spawn(_join_modes, world_size=world_size, args=(mode, False), timeout=50, pg_timeout=15)
    debug = spawn(_join_modes, world_size=world_size, args=(mode, True), timeout=50, pg_timeout=15)
    for rank in range(world_size):
        for k in plain[0]:
            assert torch.equal(plain[rank][k], plain[0][k]), (rank, k)  # everyone ends with the last joiner's model
            assert torch.equal(debug[rank][k], plain[rank][k]), (rank, k)
