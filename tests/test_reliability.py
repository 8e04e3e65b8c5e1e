"""No hangs: a dead or hung peer and ranks that fall out of step all end in named errors on every surviving rank,
within the process-group timeout."""

from __future__ import annotations

import os
import time

import pytest
import torch
from torch import nn

import gradsync
from gradsync.testing import SpawnError, spawn, spawn_failures
from lab.zoo.toys import build


def _skip_one_backward(rank: int, world_size: int) -> None:
    os.environ["GRADSYNC_DEBUG"] = "1"
    ddp = gradsync.DistributedDataParallel(build("bn"))  # BatchNorm: buffers are broadcast before each forward
    for step in range(3):
        loss = ddp(torch.randn(4, 6)).sum()
        if rank == 1 and step == 1:
            continue  # a rank-dependent skip: rank 1 goes straight to the next forward
        loss.backward()


@pytest.mark.timeout(60)
def test_desync_is_named_on_every_rank() -> None:
    failures = spawn_failures(_skip_one_backward, timeout=50, pg_timeout=10)
    assert sorted(failures) == [0, 1]
    for f in failures.values():
        assert "ranks are out of step" in f.message
        assert "rank 0: all-reduce of bucket 0" in f.message and "in synced step 2" in f.message
        assert "rank 1: broadcast of module buffers" in f.message and "in synced step 3" in f.message
        assert f.kind == "DesyncError"


def _peer_dies(rank: int, world_size: int, pg_timeout: float) -> None:
    ddp = gradsync.DistributedDataParallel(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1)))
    for step in range(4):
        loss = ddp(torch.randn(4, 8)).sum()
        if rank == 2 and step == 2:
            os._exit(1)  # killed mid-training: no exception, no goodbye
        start = time.monotonic()
        try:
            loss.backward()
        finally:
            assert time.monotonic() - start < pg_timeout + 5


@pytest.mark.timeout(90)
def test_dead_peer_fails_every_survivor_with_the_operation_named() -> None:
    failures = spawn_failures(_peer_dies, world_size=3, args=(10.0,), timeout=80, pg_timeout=10)
    assert failures[2].kind == "ProcessDied"
    for r in (0, 1):
        assert failures[r].kind == "CollectiveError"
        assert "all-reduce of bucket 0 of 1" in failures[r].message and f"failed on rank {r}" in failures[r].message
        assert "params: 1.bias, 1.weight, 0.bias, 0.weight" in failures[r].message


def _peer_hangs(rank: int, world_size: int) -> tuple[float, str]:
    ddp = gradsync.DistributedDataParallel(nn.Linear(8, 1))
    ddp(torch.randn(4, 8)).sum().backward()  # the first backward also compares the comm hooks: hang in the second
    loss = ddp(torch.randn(4, 8)).sum()
    if rank == 1:
        time.sleep(30)  # stuck (a deadlock, a stalled data loader) while rank 0 waits in the all-reduce
        return 0.0, ""
    start = time.monotonic()
    try:
        loss.backward()
    except RuntimeError as exc:
        assert "all-reduce of bucket 0" in str(exc), exc
        return time.monotonic() - start, str(exc)
    raise AssertionError("rank 0 did not fail")


@pytest.mark.long
@pytest.mark.timeout(90)
def test_hung_peer_times_out_instead_of_hanging() -> None:
    with pytest.raises(SpawnError) as info:
        spawn(_peer_hangs, timeout=12, pg_timeout=4)
    # Rank 0 gave up after the 4 s process-group timeout (and returned); rank 1 was still asleep at the deadline.
    elapsed, message = info.value.results[0]
    assert 3.5 <= elapsed <= 12
    assert "rank(s) [1] reported nothing within 2s: they never reached this collective" in message  # who is late
    assert info.value.failures[1].kind == "Timeout"


def _peer_dies_before_forward(rank: int, world_size: int) -> None:
    ddp = gradsync.DistributedDataParallel(build("bn"))  # BatchNorm: buffers are broadcast before each forward
    for step in range(3):
        ddp(torch.randn(4, 6)).sum().backward()
        if rank == 1 and step == 1:  # after step 0 the next forward's first collective is the bucket rebuild
            os._exit(1)


@pytest.mark.timeout(60)
def test_peer_death_during_buffer_broadcast_is_named() -> None:
    failures = spawn_failures(_peer_dies_before_forward, timeout=50, pg_timeout=10)
    message = failures[0].message
    assert "broadcast of module buffers before forward (3 tensors" in message and "failed on rank 0" in message
    assert "rank(s) [1] reported nothing" in message


def _large_result_then_teardown_aborts(rank: int, world_size: int) -> bytes:
    import torch.distributed as dist

    # The group's teardown aborting the process (gloo's "terminate called ... Resource deadlock avoided", seen in the
    # suite) while the queue's thread was still writing this rank's result left the parent blocked mid-message.
    dist.destroy_process_group = lambda *a, **k: os._exit(134)
    return bytes(range(256)) * (64 * 1024)  # 16 MiB: longer to write than the abort takes to come


@pytest.mark.timeout(60)
def test_a_rank_aborting_in_teardown_after_its_result_still_delivers_it() -> None:
    (out,) = spawn(_large_result_then_teardown_aborts, world_size=1, timeout=30)
    assert out == bytes(range(256)) * (64 * 1024)
