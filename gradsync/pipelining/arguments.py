"""gradsync's PipelineStage arguments, checked at construction, before torch's stage or a schedule runs anything.

Each wrong value torch would take on to a bare ``AssertionError`` deep in the first step, a deadlock, or a gloo abort
is refused here, naming the argument, what it got, what is valid and what to do. What is valid comes from torch's
schedules (2.13's ``schedules.py``): every rank of the pipeline group holds ``num_stages / group size`` stages, stage
``i`` on group rank ``i % size`` (looped) or in a V (``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``: the second
half of the stages in reverse).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradsync.ddp.module import DistributedDataParallel
from gradsync.errors import ConfigError


def check_stage(submodule: Any, stage_index: Any, num_stages: Any, group: Any) -> None:
    """Refuse a stage torch's schedules cannot run, or a model averaged over its pipeline peers."""
    if not isinstance(submodule, nn.Module):
        raise ConfigError(
            f"PipelineStage: submodule must be an nn.Module (the stage's part of the model), got "
            f"{type(submodule).__name__}"
        )
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise ConfigError(
            f"PipelineStage: group must be a torch.distributed.ProcessGroup (e.g. mesh['pp'].get_group()) or None "
            f"for the default group, got {type(group).__name__}"
        )
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if rank < 0:
        raise ConfigError(
            f"PipelineStage: rank {dist.get_rank()} is not a member of the pipeline group it was given (ranks "
            f"{dist.get_process_group_ranks(group)}): pass the group this rank belongs to, mesh['pp'].get_group()"
        )
    _check_counts(stage_index, num_stages, size)
    _check_placement(stage_index, num_stages, size, rank)
    if isinstance(submodule, DistributedDataParallel):
        _check_data_parallel_group(submodule, group)


def check_stage_callables(device: Any, dw_builder: Any, get_mesh: Any) -> None:
    """The stage's device and its optional callables, which torch's stage keeps as given and uses only at the first
    step (a device it cannot place tensors on, or a builder it calls)."""
    try:
        torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(
            f"PipelineStage: device={device!r:.60} is not a device: pass a torch.device, e.g. torch.device('cuda', "
            "local_rank) or torch.device('cpu')"
        ) from None
    for name, value in (("dw_builder", dw_builder), ("get_mesh", get_mesh)):
        if value is not None and not callable(value):
            raise ConfigError(
                f"PipelineStage: {name} must be callable or None, got {type(value).__name__} {value!r:.60}"
            )


def _check_counts(stage_index: Any, num_stages: Any, size: int) -> None:
    if not _is_int(num_stages) or num_stages < 1:
        raise ConfigError(
            f"PipelineStage: num_stages={num_stages!r}: it must be a positive int, the stages of the whole pipeline"
        )
    if num_stages % size:
        raise ConfigError(
            f"PipelineStage: num_stages={num_stages} over a pipeline group of {size} ranks: torch's schedules put "
            f"num_stages / {size} stages on every rank, so num_stages must be a multiple of {size} "
            f"({size} for one stage per rank, {2 * size} for two). Split the model into a multiple of {size} stages."
        )
    if not _is_int(stage_index) or not 0 <= stage_index < num_stages:
        raise ConfigError(
            f"PipelineStage: stage_index={stage_index!r}: it must be an int in [0, {num_stages}) "
            f"(num_stages={num_stages}; stage indices count from 0)."
        )


def _check_placement(stage_index: int, num_stages: int, size: int, rank: int) -> None:
    """The stage must be one this rank holds in torch's looped or V placement."""
    looped = [i for i in range(num_stages) if i % size == rank]
    v_shaped = [i for i in range(num_stages) if _v_rank(i, size) == rank]
    if stage_index in looped or stage_index in v_shaped:
        return
    holds = f"stage {looped[0]}" if num_stages == size else f"stages {looped} (looped) or {v_shaped} (V-shaped)"
    raise ConfigError(
        f"PipelineStage: stage_index={stage_index} on rank {rank} of the pipeline group ({size} ranks, "
        f"num_stages={num_stages}): torch's schedules run stage i on group rank i % {size}, so this rank holds "
        f"{holds}. Pass stage_index=group rank (mesh['pp'].get_local_rank()) for one stage per rank."
    )


def _v_rank(stage_index: int, size: int) -> int:
    """The group rank of ``stage_index`` in a V placement (torch's generate_stage_to_rank_mapping, style "v")."""
    position = stage_index % size
    return position if (stage_index // size) % 2 == 0 else size - 1 - position


def _check_data_parallel_group(ddp: DistributedDataParallel, group: dist.ProcessGroup | None) -> None:
    """The model's data-parallel group may share no rank but this one with the pipeline group: pipeline peers hold
    other stages (DDP's construction has given them its group's rank-0 weights already)."""
    me = dist.get_rank()
    averaged = dist.get_process_group_ranks(ddp.process_group)
    pipeline = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)  # type: ignore[arg-type]
    shared = sorted((set(averaged) & set(pipeline)) - {me})
    if shared:
        raise ConfigError(
            f"rank {me}: the stage's DistributedDataParallel averages over ranks {averaged}, which include pipeline "
            f"peers {shared} holding other stages (the pipeline group is {pipeline}): its construction already gave "
            "them rank 0's weights, and training would deadlock. Wrap each stage's module over the data-parallel "
            "dimension only, gradsync.DistributedDataParallel(stage, device_mesh=mesh['dp']), and build the stages "
            "again."
        )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
