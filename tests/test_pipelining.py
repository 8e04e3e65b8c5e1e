"""Pipeline parallelism with gradsync's data parallelism (issue 39, part 2): 4 gloo ranks on a 2 x 2 mesh ("dp",
"pp"), each pipeline stage's module wrapped in gradsync's DistributedDataParallel over mesh["dp"], driven by torch's
schedules through gradsync.pipelining.PipelineStage. After two SGD steps the parameters must equal one process
training the whole model on the whole batch, and torch's DDP under torch's stage where torch's works."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import gradsync
from gradsync.testing import spawn, spawn_failures

pipelining = pytest.importorskip("torch.distributed.pipelining")

D, MICROBATCHES, LOCAL_BATCH, STEPS = 8, 4, 8, 2
# The schedule, and the stages each pipeline rank holds (4 blocks; with 2 stages, one stage is 2 blocks).
LOOPED = {0: [0, 2], 1: [1, 3]}
V_SHAPE = {0: [0, 3], 1: [1, 2]}
SCHEDULES: dict[str, tuple[str, dict[int, list[int]] | None]] = {
    "GPipe": ("ScheduleGPipe", None),
    "1F1B": ("Schedule1F1B", None),
    "Interleaved1F1B": ("ScheduleInterleaved1F1B", LOOPED),
    "InterleavedZeroBubble": ("ScheduleInterleavedZeroBubble", LOOPED),
    "ZBVZeroBubble": ("ScheduleZBVZeroBubble", V_SHAPE),
    "DualPipeV": ("ScheduleDualPipeV", V_SHAPE),
}
# torch's DDP under torch's stage averages nothing in zero-bubble's weight passes (no gradient hook fires there).
TORCH_DDP_WORKS = {"GPipe", "1F1B", "Interleaved1F1B"}


class Block(nn.Module):
    def __init__(self, unused: bool = False) -> None:
        super().__init__()
        self.linear = nn.Linear(D, D)
        self.spare = nn.Linear(D, D) if unused else None  # never called: find_unused_parameters' case

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x))


def _blocks(unused: bool) -> list[nn.Module]:
    torch.manual_seed(0)
    return [Block(unused) for _ in range(4)]


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(2 * LOCAL_BATCH, D, generator=g), torch.randn(2 * LOCAL_BATCH, D, generator=g)


Weights = dict[int, dict[str, torch.Tensor]]  # by block index, then parameter name


def _weights(blocks: dict[int, nn.Module]) -> Weights:
    return {b: {n: p.detach().clone() for n, p in m.named_parameters()} for b, m in blocks.items()}


def _reference(unused: bool, steps: int = STEPS) -> Weights:
    """One process, the whole model, the whole batch."""
    blocks = _blocks(unused)
    model = nn.Sequential(*blocks)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        x, y = _batch(step)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return _weights(dict(enumerate(blocks)))


def _train(schedule: str, ours: bool, options: dict[str, Any], steps: int = STEPS) -> Weights:
    """This rank's stages' blocks after ``steps`` steps, by block index."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import schedules

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    dp, pp = mesh["dp"].get_local_rank(), mesh["pp"].get_local_rank()
    name, placement = SCHEDULES[schedule]
    blocks = _blocks(options.get("find_unused_parameters", False))
    held = {pp: [2 * pp, 2 * pp + 1]} if placement is None else {i: [i] for i in placement[pp]}
    n_stages = 2 if placement is None else 4
    if ours:
        from gradsync.pipelining import PipelineStage

        wrap, stage_type = gradsync.DistributedDataParallel, PipelineStage
    else:
        wrap, stage_type = torch.nn.parallel.DistributedDataParallel, pipelining.PipelineStage
    wrapped = {
        i: wrap(nn.Sequential(*(blocks[b] for b in bs)), device_mesh=mesh["dp"], **options) for i, bs in held.items()
    }
    stages = [stage_type(wrapped[i], i, n_stages, torch.device("cpu"), group=mesh["pp"].get_group()) for i in held]
    loss_fn = lambda output, target: nn.functional.mse_loss(output, target)  # noqa: E731
    runner = getattr(schedules, name)(stages[0] if placement is None else stages, MICROBATCHES, loss_fn=loss_fn)
    optimizer = torch.optim.SGD([p for w in wrapped.values() for p in w.parameters()], lr=0.1)
    for step in range(steps):
        x, y = _batch(step)
        mine = slice(dp * LOCAL_BATCH, (dp + 1) * LOCAL_BATCH)
        optimizer.zero_grad()
        inputs = (x[mine],) if any(s.is_first for s in stages) else ()
        runner.step(*inputs, **({"target": y[mine]} if any(s.is_last for s in stages) else {}))
        optimizer.step()
    return _weights({b: blocks[b] for bs in held.values() for b in bs})


def _max_diff(mine: Weights, expected: Weights) -> float:
    return max((p - expected[b][n]).abs().max().item() for b, ps in mine.items() for n, p in ps.items())


def _compare(rank: int, world: int, schedule: str, options: dict[str, Any]) -> dict[str, float]:
    torch.set_num_threads(1)
    reference = _reference(options.get("find_unused_parameters", False))
    ours = _train(schedule, True, options)
    out = {"vs_reference": _max_diff(ours, reference)}
    # static_graph: torch's DDP under torch's stage is off by 8.8e-3 after one step of 1F1B (gradsync equals the
    # one-process reference), so it is no reference there.
    if schedule in TORCH_DDP_WORKS and not options.get("static_graph"):
        # One step: torch's DDP fails in its second under torch's stage (its bucket rebuild counts every
        # micro-batch's gradient: "rebuilt parameter indices size is not same as original model parameters size").
        out["vs_torch"] = _max_diff(_train(schedule, True, options, steps=1), _train(schedule, False, options, steps=1))
    return out


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_every_schedule_trains_as_one_process_and_as_torchs_ddp(schedule: str) -> None:
    results = spawn(_compare, world_size=4, args=(schedule, {}), timeout=180, pg_timeout=60)
    for rank, r in enumerate(results):
        assert r["vs_reference"] <= 1e-6, (rank, r)
        assert r.get("vs_torch", 0.0) <= 1e-6, (rank, r)


@pytest.mark.parametrize("schedule", ["1F1B", "ZBVZeroBubble"])
@pytest.mark.parametrize(
    "options",
    [{"find_unused_parameters": True}, {"gradient_as_bucket_view": True}, {"static_graph": True}],
    ids=["find_unused", "bucket_view", "static_graph"],
)
def test_ddp_options_under_a_schedule(schedule: str, options: dict[str, Any]) -> None:
    results = spawn(_compare, world_size=4, args=(schedule, options), timeout=180, pg_timeout=60)
    for rank, r in enumerate(results):
        assert r["vs_reference"] <= 1e-6, (rank, r)
        assert r.get("vs_torch", 0.0) <= 1e-6, (rank, r)


def _torch_stage_over_gradsync(rank: int, world: int, plain_step_first: bool) -> None:
    """torch's own stage driving a gradsync stage module; with ``plain_step_first``, after a sanity check (one
    ordinary forward and backward of the wrapped stage): the refusal held only at the first synced forward, and
    training then ran silently wrong."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    torch.set_num_threads(1)
    group = torch.distributed.new_group([0, 1])
    ddp = gradsync.DistributedDataParallel(Block(), process_group=torch.distributed.new_group([rank]))
    if plain_step_first:
        ddp(torch.randn(4, D)).sum().backward()
    stage = PipelineStage(ddp, rank, 2, torch.device("cpu"), group=group)
    runner = ScheduleGPipe(stage, 2, loss_fn=lambda output, target: output.sum())
    x = torch.randn(4, D)
    runner.step(x) if rank == 0 else runner.step(target=x)


@pytest.mark.parametrize("plain_step_first", [False, True], ids=["at_once", "after_an_ordinary_step"])
def test_torchs_own_stage_over_gradsyncs_ddp_is_refused_naming_the_import_to_change(plain_step_first: bool) -> None:
    """torch's stage recognises only torch's DDP: its micro-batches would each be averaged alone, silently wrong."""
    failures = spawn_failures(
        _torch_stage_over_gradsync, world_size=2, timeout=60, pg_timeout=15, args=(plain_step_first,)
    )
    assert failures[0].kind == "ConfigError", failures
    assert "from gradsync.pipelining import PipelineStage" in failures[0].message, failures[0].message


def _ddp_over_the_pipeline_dimension(rank: int, world: int, spelling: str) -> dict[str, Any]:
    """Two ranks, two stages of different values: DDP over the pipeline dimension would give stage 1 stage 0's
    weights at construction, then deadlock at the first step."""
    from torch.distributed.device_mesh import init_device_mesh

    from gradsync.pipelining import PipelineStage

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "pp"))
    block = _blocks(False)[rank]
    before = _weights({rank: block})
    try:
        if spelling == "mesh":
            ddp = gradsync.DistributedDataParallel(block, device_mesh=mesh["pp"])
        else:
            ddp = gradsync.DistributedDataParallel(block, process_group=mesh["pp"].get_group())
        PipelineStage(ddp, rank, 2, torch.device("cpu"), group=mesh["pp"].get_group())
    except gradsync.GradsyncError as error:
        torch.distributed.barrier()  # no rank leaves (closing its sockets) while the other still connects its group
        return {"error": str(error), "kept": _max_diff(_weights({rank: block}), before) == 0.0}
    return {"error": None}


@pytest.mark.parametrize("spelling", ["mesh", "process_group"])
def test_ddp_over_the_pipeline_dimension_is_refused_naming_the_data_parallel_one(spelling: str) -> None:
    results = spawn(_ddp_over_the_pipeline_dimension, world_size=2, args=(spelling,), timeout=60, pg_timeout=15)
    for rank, result in enumerate(results):
        assert result["error"] is not None, (rank, result)
        assert "mesh['dp']" in result["error"], (rank, result)
        if spelling == "mesh":  # refused by the mesh's name before rank 0's weights are broadcast
            assert "device_mesh=mesh['pp'] names the pipeline dimension" in result["error"], result
            assert result["kept"], (rank, result)
        else:  # a bare group has no name: refused when the stage is built, naming the peers
            assert "pipeline peers [" in result["error"], result


def _bad_stage(rank: int, world: int, case: str) -> str:
    from gradsync.pipelining import PipelineStage

    torch.set_num_threads(1)
    arguments = {
        "stage_index off by one": (rank + 1, 2),
        "stage_index one less": (rank - 1, 2),
        "stage_index of the other rank": (1 - rank, 2),
        "num_stages not a multiple": (rank, 3),
        "num_stages zero": (0, 0),
        "stage_index a float": (float(rank), 2),
    }[case]
    try:
        PipelineStage(Block(), *arguments, torch.device("cpu"))
        said = "accepted"
    except gradsync.GradsyncError as error:
        said = str(error)
    torch.distributed.barrier()  # no rank leaves (closing its sockets) while the other still connects its group
    return said


BAD_STAGES = {
    "stage_index off by one": "stage_index=",
    "stage_index one less": "stage_index=-1: it must be an int in [0, 2)",
    "stage_index of the other rank": "stage_index=",
    "num_stages not a multiple": "num_stages=3 over a pipeline group of 2 ranks",
    "num_stages zero": "num_stages=0: it must be a positive int",
    "stage_index a float": ".0: it must be an int in [0, 2)",
}


@pytest.mark.parametrize("case", list(BAD_STAGES))
def test_a_stage_torchs_schedules_cannot_run_is_refused_at_construction(case: str) -> None:
    """Before: a bare AssertionError on rank 0 (stage_index off by one), SIGABRT in gloo (num_stages=3 on 2 ranks)."""
    said = spawn(_bad_stage, world_size=2, args=(case,), timeout=60, pg_timeout=15)
    assert "accepted" not in said, said  # every rank's stage is wrong in each case
    assert BAD_STAGES[case] in said[0], said[0]
    assert all(message.startswith("gradsync: PipelineStage: ") for message in said), said


def _save_stages(rank: int, world: int, path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from gradsync import checkpoint

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    blocks = _blocks(False)
    pp = mesh["pp"].get_local_rank()
    stage = (
        nn.Sequential(*blocks[2 * pp : 2 * pp + 2]) if pp == 0 else nn.Sequential(blocks[2], blocks[3], nn.Linear(D, 1))
    )
    checkpoint.save(path, model=gradsync.DistributedDataParallel(stage, device_mesh=mesh["dp"]))


def test_gradsync_checkpoint_refuses_ranks_holding_different_stages_naming_distributed_checkpoint(tmp_path) -> None:
    """One file holds rank 0's copy: the other stage's layers would be lost without a word."""
    failures = spawn_failures(_save_stages, world_size=4, args=(str(tmp_path / "ckpt.pt"),), timeout=60, pg_timeout=15)
    assert sorted(failures) == [0, 1, 2, 3] and all(f.kind == "CheckpointError" for f in failures.values()), failures
    assert "torch.distributed.checkpoint" in failures[0].message and "rank 1's model=" in failures[0].message
    assert not (tmp_path / "ckpt.pt").exists()
