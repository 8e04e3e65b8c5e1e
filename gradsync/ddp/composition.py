"""What DDP composes with. At construction: tensor parallelism's DTensor parameters over a data-parallel group
orthogonal to their mesh, gradsync's own DDP inside it (as torch accepts a DDP inside a DDP), and refusals, each
naming what to do, of a module already in torch's DDP or FSDP, DTensor parameters whose averaging group would mix
their shards, and a pipeline dimension given as the data-parallel one. At every synced forward (:class:`InUse`):
torch's own pipeline stage as the caller, refused, ``torch.func.functional_call``'s parameters, taken as torch's
DDP takes them, and parameters replaced for good after wrapping, refused."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.distributed as dist
from torch import nn

from gradsync.ddp.callers import TorchStageLook, inside_functional_call
from gradsync.errors import ConfigError
from gradsync.reducer.local_params import is_dtensor
from gradsync.torch_private.tensor_parallel import fsdp_module_types

# torch's class, bound when gradsync is imported: torch's DDP test suite run with gradsync later puts gradsync's class
# under torch's name (conformance/torch_suite), and a gradsync model inside a gradsync model is accepted.
_TORCH_DDP: type = nn.parallel.DistributedDataParallel
# What torch's docs and torchtitan name a mesh's pipeline dimension.
PIPELINE_DIMENSIONS = frozenset({"pp", "pipe", "pipeline"})


def check_composition(
    module: nn.Module, process_group: dist.ProcessGroup | None, device_mesh: Any, as_view: bool, wrapper: type
) -> None:
    """Refuse a module gradsync's DDP cannot average correctly, naming the module or parameter and the fix.
    ``as_view``: the wrapper's gradient_as_bucket_view; ``wrapper``: gradsync's DDP class (:func:`check_nesting`)."""
    refuse_pipeline_dimension(device_mesh)
    check_nesting(module, as_view, wrapper)
    if isinstance(module, _TORCH_DDP) and _TORCH_DDP.__module__.startswith("torch."):
        raise ConfigError(
            "the module is already wrapped in torch's DistributedDataParallel (torch.nn.parallel), whose reducer "
            "would average its gradients alongside gradsync's. Wrap the plain model (ddp.module) in "
            "gradsync.DistributedDataParallel instead."
        )
    fsdp = fsdp_module_types()
    for name, sub in module.named_modules():
        if fsdp and isinstance(sub, fsdp):
            raise ConfigError(
                f"module '{name or '<root>'}' is sharded by FSDP ({type(sub).__name__}), which already reduces its "
                "gradients over its mesh: wrapping it in DDP too would average them twice. For data parallelism "
                "with FSDP use fully_shard's 2-D mesh (HSDP); gradsync's DDP takes unsharded or tensor-parallel models."
            )
    check_tensor_parallel(module, process_group, device_mesh)


def check_tensor_parallel(module: nn.Module, process_group: dist.ProcessGroup | None, device_mesh: Any) -> None:
    """DTensor parameters need a data-parallel group that shares no rank but this one with their mesh."""
    sharded = [(n, p) for n, p in module.named_parameters() if is_dtensor(p)]
    if not sharded:
        return
    name, param = sharded[0]
    if process_group is None and device_mesh is None:
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


def check_nesting(module: nn.Module, as_view: bool, wrapper: type) -> None:
    """gradsync's DDP (``wrapper``) inside the model is accepted, as torch's DDP accepts torch's (its test
    ``test_ddp_static_graph_nested_types``): both hook the same parameters and each averages their local gradients,
    so ``.grad`` holds the average, all-reduced twice; the inner one alone averages as before. Not with
    gradient_as_bucket_view on either: each would make ``.grad`` a view of its own bucket (torch's DDP then fails,
    or averages wrongly, silently)."""
    inner = [(name or "<root>", sub) for name, sub in module.named_modules() if isinstance(sub, wrapper)]
    viewed = [name for name, sub in inner if as_view or getattr(sub, "gradient_as_bucket_view", False)]
    if viewed:
        raise ConfigError(
            f"module '{viewed[0]}' is a gradsync DistributedDataParallel already, and with gradient_as_bucket_view "
            "both wrappers would make .grad a view of their own bucket: the gradients would come out wrong. Wrap "
            "the plain model once (ddp.module), or pass gradient_as_bucket_view=False to both."
        )


def refuse_pipeline_dimension(device_mesh: Any) -> None:
    """Before the model check and rank 0's broadcast: a data-parallel group along the pipeline dimension would
    overwrite each stage's weights with stage 0's, then deadlock (the ranks hold different stages)."""
    names: tuple[str, ...] = tuple(getattr(device_mesh, "mesh_dim_names", None) or ())
    if len(names) == 1 and names[0].lower() in PIPELINE_DIMENSIONS:
        raise ConfigError(
            f"device_mesh=mesh[{names[0]!r}] names the pipeline dimension, whose ranks hold different pipeline "
            "stages: averaging over it would give every stage stage 0's weights. Pass the data-parallel dimension, "
            "device_mesh=mesh['dp'], and the pipeline one to the stage: "
            f"gradsync.pipelining.PipelineStage(..., group=mesh[{names[0]!r}].get_group())."
        )


class InUse:
    """At every synced forward (and :meth:`~gradsync.DistributedDataParallel.sync_next_backward`): what construction
    could not see. Called, it returns whether this step's backward averages. ``named``: the parameters DDP hooked.

    Cheap per step: a look up the stack only where torch's pipelining was imported, and one dictionary lookup for
    the first parameter; the whole list is compared at the first synced forward, and again only when the first
    parameter is not the module's (``functional_call``, or a replacement after wrapping)."""

    def __init__(self, module: nn.Module, named: Sequence[tuple[str, nn.Parameter]], rank: int, find_unused: bool):
        self._module = module
        self._named = named
        self._rank = rank
        self._find_unused = find_unused
        owner, _, attribute = named[0][0].rpartition(".") if named else ("", "", "")
        self._first = (module.get_submodule(owner), attribute, named[0][1]) if named else None
        self._replaced_checked = False
        self._torch_stage_calling = TorchStageLook()

    def __call__(self) -> bool:
        stage = self._torch_stage_calling()
        if stage is not None:
            refuse_torch_pipeline_stage(stage, self._rank)
        if self._replaced_checked and self._first_in_place():
            return True
        if inside_functional_call():
            return self._swapped_for_one_call()
        # Outside functional_call: once, the whole list; then whenever the first parameter is not the module's.
        self._replaced_checked = True
        refuse_replaced_parameters(self._module, self._named, self._rank)
        return True

    def _first_in_place(self) -> bool:
        if self._first is None:
            return True
        owner, attribute, parameter = self._first
        return getattr(owner, attribute, None) is parameter

    def _swapped_for_one_call(self) -> bool:
        """Inside ``torch.func.functional_call(ddp, tensors, ...)``, whose tensors stand in for the module's during
        the call. As with torch's DDP: the tensors passed get their gradients locally, unaveraged (DDP's hooks are
        on the module's own parameters); with all of them passed, this backward averages nothing. With some passed,
        the others' buckets would wait for gradients that never reach DDP (torch's DDP fails at the next forward),
        unless find_unused_parameters marks the replaced ones unused."""
        replaced = replaced_names(self._module, self._named)
        if not replaced:
            return True
        if len(replaced) == len(self._named):
            return False
        if self._find_unused:
            return True
        more = f" (and {len(replaced) - 1} more)" if len(replaced) > 1 else ""
        raise ConfigError(
            f"rank {self._rank}: torch.func.functional_call replaced parameter 'module.{replaced[0]}'{more} of "
            f"DistributedDataParallel but not the other {len(self._named) - len(replaced)}: their gradients would be "
            "averaged in buckets that wait for the replaced parameters' too, which never reach DDP (torch's DDP "
            "fails at the next forward: 'Expected to have finished reduction in the prior iteration'). Pass every "
            "parameter to functional_call (the tensors passed get their gradients unaveraged, as in torch), or wrap "
            "with find_unused_parameters=True."
        )


def refuse_torch_pipeline_stage(stage: str, rank: int) -> None:
    """Refuse being the module of torch's PipelineStage (``stage``, its class), which takes its data-parallel path
    only for torch's DDP class. Every micro-batch's forward would arm the reducer and the first backward average
    alone, the others accumulating on top: gradients silently wrong."""
    raise ConfigError(
        f"rank {rank}: gradsync's DistributedDataParallel is the module of torch's {stage}, which runs data "
        "parallelism only for torch's DDP class: each micro-batch's backward would be averaged on its own and the "
        "gradients would come out wrong. Use gradsync.pipelining.PipelineStage: change "
        "`from torch.distributed.pipelining import PipelineStage` to `from gradsync.pipelining import PipelineStage` "
        "(same arguments; the schedules stay torch's)."
    )


def replaced_names(module: nn.Module, named: Sequence[tuple[str, nn.Parameter]]) -> list[str]:
    """The names of ``named``'s parameters that are no longer the module's."""
    current = {id(p) for p in module.parameters()}
    return [name for name, p in named if id(p) not in current]


def refuse_replaced_parameters(module: nn.Module, named: Sequence[tuple[str, nn.Parameter]], rank: int) -> None:
    """Each parameter DDP hooked is still the module's. A tensor-parallel plan applied after wrapping (or
    ``load_state_dict(assign=True)``) puts new Parameter objects in the module; the old ones keep the hooks, and the
    new ones' gradients would never be averaged."""
    replaced = replaced_names(module, named)
    if replaced:
        more = f" (and {len(replaced) - 1} more)" if len(replaced) > 1 else ""
        raise ConfigError(
            f"rank {rank}: parameter '{replaced[0]}'{more} was replaced in the module after DistributedDataParallel "
            "was constructed (a tensor-parallel plan, parallelize_module, applied to the wrapped model, or "
            "load_state_dict(assign=True)): its gradients would never be averaged. Apply the plan, or replace "
            "the parameters, first, then wrap the model."
        )
