"""What DDP composes with, checked at construction: tensor parallelism's DTensor parameters over a data-parallel
group orthogonal to their mesh, and refusals, each naming what to do, of a module already data-parallel (torch's
DDP, FSDP) or DTensor parameters whose averaging group would mix their shards."""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist
from torch import nn

from gradsync.errors import ConfigError
from gradsync.reducer.local_params import is_dtensor
from gradsync.torch_private.pipelining import torch_stage_calling
from gradsync.torch_private.tensor_parallel import fsdp_module_types


def check_composition(module: nn.Module, process_group: dist.ProcessGroup | None, mesh_given: bool) -> None:
    """Refuse a module gradsync's DDP cannot average correctly, naming the module or parameter and the fix."""
    if isinstance(module, nn.parallel.DistributedDataParallel):
        raise ConfigError(
            "the module is already wrapped in torch's DistributedDataParallel: its gradients would be averaged twice. "
            "Wrap the plain model (ddp.module) in gradsync.DistributedDataParallel instead."
        )
    fsdp = fsdp_module_types()
    for name, sub in module.named_modules():
        if fsdp and isinstance(sub, fsdp):
            raise ConfigError(
                f"module '{name or '<root>'}' is sharded by FSDP ({type(sub).__name__}), which already reduces its "
                "gradients over its mesh: wrapping it in DDP too would average them twice. For data parallelism "
                "with FSDP use fully_shard's 2-D mesh (HSDP); gradsync's DDP takes unsharded or tensor-parallel models."
            )
    sharded = [(n, p) for n, p in module.named_parameters() if is_dtensor(p)]
    if not sharded:
        return
    name, param = sharded[0]
    if process_group is None and not mesh_given:
        raise ConfigError(
            f"parameter '{name}' is a DTensor (tensor parallelism, over a mesh of {tuple(param.device_mesh.shape)}), "  # type: ignore[attr-defined]
            "but no data-parallel group was given, so DDP would average over every rank, tensor-parallel peers "
            "included. Pass device_mesh=mesh['dp'] (the data-parallel dimension of the mesh the plan used) or "
            "process_group=mesh['dp'].get_group()."
        )
    group_ranks = set(dist.get_process_group_ranks(process_group or dist.group.WORLD))  # type: ignore[arg-type]
    me = dist.get_rank()
    for name, param in sharded:
        mesh_ranks = set(param.device_mesh.mesh.flatten().tolist())  # type: ignore[attr-defined]
        shared = sorted((mesh_ranks & group_ranks) - {me})
        if shared:
            raise ConfigError(
                f"rank {me}: parameter '{name}' is a DTensor over ranks {sorted(mesh_ranks)}, and DDP's group "
                f"{sorted(group_ranks)} includes ranks {shared} of that mesh too: averaging would mix different "
                "shards. Give DDP the data-parallel dimension only: device_mesh=mesh['dp'], with the plan applied "
                "over mesh['tp']."
            )


def refuse_torch_pipeline_stage(rank: int) -> None:
    """At the first synced forward: refuse being the module of torch's PipelineStage, which takes its data-parallel
    path only for torch's DDP class. Every micro-batch's forward would arm the reducer and the first backward average
    alone, the others accumulating on top: gradients silently wrong."""
    stage = torch_stage_calling()
    if stage is not None:
        raise ConfigError(
            f"rank {rank}: gradsync's DistributedDataParallel is the module of torch's {stage}, which runs data "
            "parallelism only for torch's DDP class: each micro-batch's backward would be averaged on its own and the "
            "gradients would come out wrong. Change `from torch.distributed.pipelining import PipelineStage` to "
            "`from gradsync.pipelining import PipelineStage` (same arguments; the schedules stay torch's)."
        )


def refuse_replaced_parameters(module: nn.Module, named: Sequence[tuple[str, nn.Parameter]], rank: int) -> None:
    """At the first synced forward: each parameter DDP hooked is still the module's. A tensor-parallel plan applied
    after wrapping (or ``load_state_dict(assign=True)``) puts new Parameter objects in the module; the old ones keep
    the hooks, and the new ones' gradients would never be averaged."""
    current = {id(p) for p in module.parameters()}
    replaced = [name for name, p in named if id(p) not in current]
    if replaced:
        more = f" (and {len(replaced) - 1} more)" if len(replaced) > 1 else ""
        raise ConfigError(
            f"rank {rank}: parameter '{replaced[0]}'{more} was replaced in the module after DistributedDataParallel "
            "was constructed (a tensor-parallel plan, parallelize_module, applied to the wrapped model, or "
            "load_state_dict(assign=True)): its gradients would never be averaged. Apply the plan, or replace "
            "the parameters, first, then wrap the model."
        )
