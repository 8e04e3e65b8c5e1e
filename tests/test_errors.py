"""Errors are part of the product: each names the parameter and rank, says what to do, and reaches every rank
within the process-group timeout — never a hang."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

import gradsync
from gradsync.collectives.communicator import Communicator
from gradsync.collectives.peer_errors import PeerReports
from gradsync.runtime.env import ELASTIC_STORE_VARIABLE
from gradsync.testing import spawn, spawn_failures
from lab.zoo.toys import SometimesUsed


def _mismatch(rank: int, world_size: int) -> None:
    layers = [nn.Linear(4, 4), nn.Linear(4, 2)]
    if rank == 1:
        layers.insert(1, nn.Linear(4, 4))  # a rank-dependent extra layer
    gradsync.DistributedDataParallel(nn.Sequential(*layers))


@pytest.mark.timeout(60)
def test_mismatched_models_name_the_parameter_on_every_rank() -> None:
    failures = spawn_failures(_mismatch, timeout=50, pg_timeout=10)
    assert sorted(failures) == [0, 1]
    for f in failures.values():
        assert f.kind == "ModelMismatchError"  # a gradsync.GradsyncError and a ValueError
        assert "rank 1 differs from rank 0 at parameter #2" in f.message
        assert "'1.weight' shape=[2, 4]" in f.message and "'1.weight' shape=[4, 4]" in f.message


def _unused_everywhere(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    ddp = gradsync.DistributedDataParallel(SometimesUsed())
    ddp(torch.randn(2, 6)).sum().backward()


@pytest.mark.timeout(60)
def test_unused_parameter_without_flag_is_named_on_every_rank() -> None:
    failures = spawn_failures(_unused_everywhere, timeout=50, pg_timeout=10)
    for f in failures.values():
        assert f.kind == "GradientError"
        assert "never.weight, never.bias" in f.message and "find_unused_parameters=True" in f.message


def _unused_on_rank1(rank: int, world_size: int, pg_timeout: float) -> None:
    torch.manual_seed(0)
    model = SometimesUsed()
    model.never.requires_grad_(False)
    ddp = gradsync.DistributedDataParallel(model, bucket_cap_mb=0.0005)
    start = time.monotonic()
    try:
        ddp(torch.randn(2, 6), use_extra=(rank == 0)).sum().backward()
    finally:
        elapsed = time.monotonic() - start
        assert elapsed < pg_timeout + 10, f"rank {rank} took {elapsed:.1f}s to fail"


@pytest.mark.timeout(90)
def test_unused_on_one_rank_fails_every_rank_with_the_cause() -> None:
    pg_timeout = 5.0
    failures = spawn_failures(_unused_on_rank1, args=(pg_timeout,), timeout=60, pg_timeout=pg_timeout)
    assert sorted(failures) == [0, 1]
    # Rank 1 knows at once; rank 0 was waiting in the all-reduce and learns the cause from rank 1's report.
    assert "rank 1: 2 parameter(s) received no gradient" in failures[1].message
    assert "extra.weight, extra.bias" in failures[1].message
    assert "all-reduce of bucket" in failures[0].message
    assert "rank 1 reported" in failures[0].message and "find_unused_parameters=True" in failures[0].message


def _bad_arguments(rank: int, world_size: int) -> list[str]:
    messages = []
    for make in (
        lambda: gradsync.DistributedDataParallel(nn.Linear(2, 2), bucket_cap_mb=0),
        lambda: gradsync.DistributedDataParallel(nn.Linear(2, 2).requires_grad_(False)),
        lambda: gradsync.DistributedDataParallel(nn.Linear(2, 2), mixed_precision=object()),
        lambda: gradsync.DistributedDataParallel(nn.Linear(2, 2), bucket_size=3),
        lambda: gradsync.DistributedDataParallel("not a module"),
        lambda: gradsync.DistributedDataParallel(nn.Linear(2, 2), bucket_cap_mb=float("nan")),
        lambda: gradsync.DistributedDataParallel(nn.Linear(2, 2), bucket_cap_mb=float("inf")),
        lambda: gradsync.DistributedDataParallel(nn.Linear(2, 2), device_ids=["cuda:0"]),
        lambda: gradsync.DistributedDataParallel(nn.Linear(2, 2), output_device="gpu"),
        lambda: gradsync.DistributedDataParallel(nn.Linear(2, 2), device_mesh="1d"),
        lambda: gradsync.DistributedDataParallel(nn.Linear(2, 2)).register_comm_hook(None, lambda bucket: bucket),
    ):
        try:
            make()
            messages.append("no error")
        except (TypeError, ValueError) as exc:
            kind = "ValueError" if isinstance(exc, ValueError) else type(exc).__name__
            messages.append(f"{kind}: {exc}")
    return messages


@pytest.mark.timeout(60)
def test_bad_arguments_say_what_to_change() -> None:
    msgs = spawn(_bad_arguments, timeout=50)[0]
    assert msgs[0].startswith("ValueError: gradsync: bucket_cap_mb must be a finite number > 0")
    assert msgs[1].startswith("ValueError") and "doesn't have any parameter that requires a gradient" in msgs[1]
    assert msgs[2].startswith("ValueError") and "mixed_precision must be a gradsync.MixedPrecision" in msgs[2]
    assert msgs[3].startswith("TypeError") and "'bucket_size'" in msgs[3] and "no such argument" in msgs[3]
    assert msgs[4].startswith("TypeError") and "wraps an nn.Module" in msgs[4]
    assert all(m.startswith("ValueError: gradsync: bucket_cap_mb must be a finite number > 0") for m in msgs[5:7])
    assert "device_ids=['cuda:0'] names a cuda device but the module's parameters are on cpu" in msgs[7]
    assert msgs[8] == (
        "ValueError: gradsync: output_device: 'gpu' is not a device; pass an index or a device such as 'cuda:0' "
        "or torch.device('cuda', local_rank)"
    )
    assert msgs[9].startswith("TypeError: device_mesh must be a torch.distributed.device_mesh.DeviceMesh")
    assert msgs[10].startswith("TypeError: register_comm_hook: hook '") and "must take two arguments" in msgs[10]


def _hook_on_rank_0_only(rank: int, world_size: int) -> None:
    ddp = gradsync.DistributedDataParallel(nn.Linear(4, 4))
    if rank == 0:
        ddp.register_comm_hook(None, bf16_compress_hook)
    ddp(torch.randn(2, 4)).sum().backward()


@pytest.mark.timeout(60)
def test_a_comm_hook_on_some_ranks_only_is_named_instead_of_aborting() -> None:
    failures = spawn_failures(_hook_on_rank_0_only, timeout=50, pg_timeout=10)
    assert sorted(failures) == [0, 1]
    for f in failures.values():
        assert f.kind == "ConfigError"
        assert (
            "rank(s) [0]: comm hook torch.distributed.algorithms.ddp_comm_hooks.default_hooks.bf16_compress_hook"
            in f.message
        )
        assert "rank(s) [1]: no comm hook" in f.message and "not under `if rank == 0:`" in f.message


def _extra_no_sync_on_rank_0(rank: int, world_size: int) -> list[list[float]]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    ddp = gradsync.DistributedDataParallel(net)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(4):
        opt.zero_grad()
        if rank == 0 and step == 1:  # data-dependent accumulation on one rank: its buffers broadcast a forward early
            with ddp.no_sync():
                ddp(torch.randn(8, 4)).sum().backward()
        ddp(torch.randn(8, 4)).sum().backward()
        opt.step()
    return [p.detach().flatten().tolist() for p in net.parameters()]


@pytest.mark.timeout(60)
def test_an_extra_no_sync_micro_batch_on_one_rank_keeps_the_collectives_in_step() -> None:
    # It used to pair rank 0's buffer broadcast with rank 1's bucket-rebuild broadcast, and gloo aborted.
    results = spawn(_extra_no_sync_on_rank_0, timeout=50)
    assert results[0] == results[1]


def test_no_process_group_says_how_to_start_one() -> None:
    with pytest.raises(RuntimeError, match="needs an initialised process group"):
        gradsync.DistributedDataParallel(nn.Linear(2, 2))


class _Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        return self.b(self.a(x)) if use_b else self.a(x)


def _static_graph_loses_a_parameter(rank: int, world_size: int) -> None:
    ddp = gradsync.DistributedDataParallel(_Branchy(), static_graph=True)
    for use_b in (True, True, False):  # used in the first iterations (the rebuild silences hooks), then unused
        ddp.zero_grad()
        ddp(torch.randn(2, 4), use_b).sum().backward()


@pytest.mark.timeout(60)
def test_a_static_graph_that_loses_a_parameter_says_so_in_torchs_words() -> None:
    failures = spawn_failures(_static_graph_loses_a_parameter, timeout=50, pg_timeout=10)
    assert sorted(failures) == [0, 1]
    for rank, f in failures.items():
        assert f.kind == "GradientError" and f"rank {rank}: 2 parameter(s) received no gradient" in f.message
        assert "b.weight" in f.message and "b.bias" in f.message and "a.weight" not in f.message
        assert "Expected to have finished reduction in the prior iteration" in f.message
        assert "this is not compatible with static_graph set to True" in f.message


def _skips_a_backward(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    ddp = gradsync.DistributedDataParallel(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1)))
    for step in range(3):
        loss = ddp(torch.randn(8, 4)).sum()
        if rank == 1 and step == 1:
            continue  # a rank-dependent skip: rank 1's next forward broadcasts while rank 0 all-reduces
        loss.backward()


@pytest.mark.timeout(90)
def test_ranks_out_of_step_without_debug_are_called_so_with_the_way_to_find_where() -> None:
    failures = spawn_failures(_skips_a_backward, timeout=80, pg_timeout=10)
    said = " ".join(f.message for f in failures.values())
    assert "the ranks are out of step" in said and "GRADSYNC_DEBUG=1" in said


def _skips_a_whole_step(rank: int, world_size: int) -> None:
    os.environ["GRADSYNC_DEBUG"] = "1"
    torch.manual_seed(0)
    ddp = gradsync.DistributedDataParallel(nn.Linear(4, 1))
    for step in range(4):
        if rank == 1 and step == 1:
            continue  # no forward, no backward: to the other ranks, indistinguishable from the next step
        ddp(torch.randn(8, 4)).sum().backward()


@pytest.mark.timeout(90)
def test_a_skipped_step_under_debug_is_named_by_how_far_each_rank_got() -> None:
    failures = spawn_failures(_skips_a_whole_step, timeout=80, pg_timeout=10)
    assert list(failures) == [0]  # rank 1 finished its 3 steps; rank 0 waits in its 4th
    assert "rank 1 at synced step 3, this rank at step 4" in failures[0].message


def _waits_in_a_group_that_recovers_itself(rank: int, world_size: int) -> tuple[list[float], str] | None:
    from gradsync.collectives import peer_errors

    store = dist.distributed_c10d._get_default_store()
    if rank == 0:
        peer_errors.post_error_for(store, 1, "all-reduce of bucket 0 failed on rank 1: Connection closed by peer")
        waits = []
        for awaited in (True, False):  # rank 2 is silent (a host lost whole: no one posts for it)
            start = time.monotonic()
            reports = peer_errors.PeerReports(awaited=awaited)
            text = reports.describe(grace=1.0, collective="all-reduce of bucket 0")
            waits.append(time.monotonic() - start)
        dist.barrier()
        return waits, text
    dist.barrier()
    return None


@pytest.mark.timeout(60)
def test_a_group_whose_members_recover_themselves_waits_for_no_report(monkeypatch: pytest.MonkeyPatch) -> None:
    """An elastic round's group (its communicators made with reports not awaited, the rule of every worker of
    `gradsync run --elastic`): the next round's leader learns who is gone, and a survivor whose collective failed
    waiting out the grace for a lost host's report (no launcher is left to post it) would hold up its recovery."""
    assert PeerReports.for_this_process().awaited
    monkeypatch.setenv(ELASTIC_STORE_VARIABLE, "127.0.0.1:1")
    assert not PeerReports.for_this_process().awaited and not Communicator().reports.awaited
    monkeypatch.delenv(ELASTIC_STORE_VARIABLE)
    waits, text = spawn(_waits_in_a_group_that_recovers_itself, 3, timeout=50)[0]
    assert waits[0] >= 1.0 and waits[1] < 0.2, waits  # the same silent rank: the grace, then no wait
    assert "reported nothing" not in text  # nor a list of the silent: the members' next round names who is gone
    assert "rank 1 reported: all-reduce of bucket 0 failed on rank 1" in text  # what was posted is still said
