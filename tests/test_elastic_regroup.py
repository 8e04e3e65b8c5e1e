"""A regroup (gradsync.elastic forms a new process group each membership round) keeps the comm hook and the Monitor:
in two processes, training with a hook, then a fresh group and ``rebuild_for_new_group()`` (what
``State.recover`` does), then more training. The hook must keep running, the Monitor keep recording, and where the
hook keeps no per-rank memory the run must equal one without the regroup, bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

import gradsync
from gradsync.collectives.communicator import Communicator, Op
from gradsync.comm import DiLoCo, QuantizedState, allreduce_hook, bf16_compress_hook, quantized_hook
from gradsync.errors import ConfigError
from gradsync.observe import Monitor
from gradsync.testing import spawn

STEPS_BEFORE, STEPS_AFTER = 2, 4  # DiLoCo (period 2): the regroup and the end fall on outer steps


def _new_group(round_number: int) -> None:
    """What gradsync.elastic's form_group does: the old group destroyed, a new one on a fresh store prefix."""
    store = dist.distributed_c10d._get_default_store()
    rank, world = dist.get_rank(), dist.get_world_size()
    dist.destroy_process_group()
    prefix = dist.PrefixStore(f"round{round_number}/", store)
    dist.init_process_group("gloo", store=prefix, rank=rank, world_size=world)


def _register(ddp: gradsync.DistributedDataParallel, mode: str, calls: list[int]) -> DiLoCo | None:
    if mode == "diloco":
        return DiLoCo(ddp, period=2, outer_lr=0.7, momentum=0.9)
    hooks = {
        "counting": (None, allreduce_hook),
        "world_group": (dist.group.WORLD, allreduce_hook),  # a state holding the old group
        "bf16": (None, bf16_compress_hook),
        "powersgd": (PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2), powerSGD_hook),
        "quantized": (QuantizedState(None, bits=8), quantized_hook),
    }
    state, hook = hooks[mode]

    def counting(s, bucket):  # type: ignore[no-untyped-def]
        calls.append(1)
        return hook(s, bucket)

    ddp.register_comm_hook(state, counting)
    return None


def _train(rank: int, world: int, mode: str, regroup: bool) -> dict:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    # Several buckets (PowerSGD's ran one at a time on gloo: its callbacks' collectives would interleave).
    ddp = gradsync.DistributedDataParallel(module, bucket_cap_mb=0.0002)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    calls: list[int] = []
    diloco = _register(ddp, mode, calls)
    monitor = Monitor(ddp, opt)
    g = torch.Generator().manual_seed(rank)
    data = [(torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)) for _ in range(STEPS_BEFORE + STEPS_AFTER)]

    per_step: list[int] = []

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()
        before = len(calls)
        nn.functional.mse_loss(ddp(x), y).backward()
        per_step.append(len(calls) - before)
        opt.step()
        if diloco is not None:
            diloco.step()

    for x, y in data[:STEPS_BEFORE]:
        step(x, y)
    calls_before, recorded_before = len(calls), len(monitor.steps)
    if regroup:
        _new_group(2)
        ddp.rebuild_for_new_group()
        ddp.load_shared_replica(Communicator().broadcast_object(Op.ELASTIC_STATE, ddp.shared_replica()))  # as State
    for x, y in data[STEPS_BEFORE:]:
        step(x, y)
    return {
        "params": [p.detach().clone() for p in module.parameters()],
        "calls": (calls_before, len(calls)),
        "calls_per_step": per_step,
        "recorded": (recorded_before, len(monitor.steps)),
        "diloco_steps": None if diloco is None else diloco.step_count,
    }


# No per-rank memory: the regroup changes nothing. (DiLoCo: at an outer step, where the ranks agree; between two, every
# member carries on from rank 0's parameters, and the members agree again at the next outer step.)
EXACT = ("counting", "world_group", "bf16", "diloco")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", [*EXACT, "powersgd", "quantized"])
def test_a_regroup_keeps_the_comm_hook_and_the_monitor(mode: str) -> None:
    ours = spawn(_train, 2, args=(mode, True), timeout=100)
    for result in ours:
        before, after = result["recorded"]
        assert (before, after) == (STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER), "the Monitor stopped recording"
        if mode != "diloco":
            buckets = result["calls_per_step"][STEPS_BEFORE - 1]  # the last step before the regroup
            assert buckets >= 3, result["calls_per_step"]  # several buckets, not one
            # The new group's reducer starts from rank 0's rebuilt buckets (shared_replica): no step of one bucket.
            assert result["calls_per_step"][STEPS_BEFORE:] == [buckets] * STEPS_AFTER, f"{mode}: {result}"
    for a, b in zip(ours[0]["params"], ours[1]["params"]):  # the members agree after the regroup
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    if mode in EXACT:
        plain = spawn(_train, 2, args=(mode, False), timeout=100)
        for a, b in zip(ours[0]["params"], plain[0]["params"]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_powersgd_members_share_the_generator_and_drop_their_own_memory() -> None:
    """A worker that joins has a fresh PowerSGDState; every member must draw the same Q as rank 0 from now on, and
    a survivor's P/Q and error memory (sized for the old buckets) must go."""
    from gradsync.comm import regroup

    survivor = PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2, random_seed=0)
    survivor.rng.rand(5)  # it has drawn Q matrices already
    survivor.iter = 7
    survivor.error_dict[0] = torch.ones(3)
    survivor.p_memory_dict[0] = torch.ones(3)
    joiner = PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2, random_seed=0)
    assert regroup.for_new_group(survivor, powerSGD_hook) is survivor
    assert not survivor.error_dict and not survivor.p_memory_dict
    shared = regroup.shared_state(survivor, powerSGD_hook)
    regroup.load_shared_state(joiner, powerSGD_hook, shared)
    assert joiner.iter == 7 and joiner.rng.randint(1_000_000_000) == survivor.rng.randint(1_000_000_000)
    quantized = QuantizedState(None, bits=8)
    quantized._residuals[0] = torch.ones(3)
    regroup.for_new_group(quantized, quantized_hook)
    assert not quantized._residuals


def _late_plan(rank: int, world: int) -> str:
    torch.manual_seed(0)
    ddp = gradsync.DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4)), bucket_cap_mb=0.0002)
    for _ in range(2):
        ddp(torch.randn(4, 8)).sum().backward()
    shared = ddp.shared_replica()
    assert shared.layout is not None and sorted(shared.layout[0]) == [0, 1, 2, 3]
    try:
        ddp.load_shared_replica(shared)
    except ConfigError as exc:
        return str(exc)
    return "taken"


def test_a_bucket_plan_is_refused_once_the_reducer_has_run() -> None:
    for message in spawn(_late_plan, 2, timeout=50):
        assert "already ran 2 synced backward(s)" in message and "before the first synced forward" in message


def test_a_shared_replica_is_refused_in_any_other_shape(group_of_one) -> None:  # type: ignore[no-untyped-def]
    """What the round's rank 0 sends is a SharedReplica; the old (hook state, layout) pair is refused by name."""
    ddp = gradsync.DistributedDataParallel(nn.Linear(4, 4))
    with pytest.raises(ConfigError, match=r"load_shared_replica takes what shared_replica\(\) returned .* not tuple"):
        ddp.load_shared_replica((None, None))  # type: ignore[arg-type]
    ddp.load_shared_replica(ddp.shared_replica())  # its own, before any forward: taken
