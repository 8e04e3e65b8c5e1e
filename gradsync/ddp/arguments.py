"""DistributedDataParallel's constructor arguments: torch's names and meanings, checked at the boundary.

Each check names the argument, what it got and what to pass instead; where torch accepts an argument gradsync does
not implement, it is refused rather than ignored. :class:`Config` is what the reducer is built from.
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradsync import settings, torch_private
from gradsync.errors import ConfigError
from gradsync.reducer.caps import BucketCaps
from gradsync.reducer.mode import GraphMode


def refuse_unsupported(unsupported: Mapping[str, Any]) -> None:
    """A keyword torch's DDP does not take either is refused, never ignored (every one of torch's is gradsync's)."""
    for name in unsupported:
        raise TypeError(
            f"gradsync.DistributedDataParallel: unexpected argument '{name}' (torch's DDP has no such argument)"
        )


# The constructor's on/off arguments.
SWITCHES = (
    "broadcast_buffers",
    "init_sync",
    "find_unused_parameters",
    "check_reduction",
    "gradient_as_bucket_view",
    "static_graph",
    "skip_all_reduce_unused_params",
    "batched_grad_copy",
    "forward_sync_buffers",
    "bucket_tuning",
    "check_desync",
)


def refuse_string_switches(arguments: Mapping[str, object]) -> None:
    """torch's DDP reads its switches' truth, so it takes any object for them; but a string is never meant: a value
    from a config file, ``find_unused_parameters="false"``, is true in Python. Refused by name. ``arguments``: the
    constructor's, of which the :data:`SWITCHES` are read."""
    for name in SWITCHES:
        value = arguments[name]
        if isinstance(value, (str, bytes)):
            raise ConfigError(
                f"DistributedDataParallel: {name} must be True or False, got str {value!r}: a string is true whatever "
                f"it says; pass {name}={str(value).strip().lower() in ('1', 'true', 'yes', 'on')}"
            )


def check_cap_list(cap_list: object) -> None:
    """``bucket_cap_mb_list``: None, or one cap per bucket (MiB). torch takes an empty list for "not given", and
    iterates a number (a TypeError): both are a mistake for ``bucket_cap_mb``'s one cap."""
    if cap_list is None:
        return
    if not isinstance(cap_list, Sequence) or isinstance(cap_list, (str, bytes)):
        raise ConfigError(
            f"bucket_cap_mb_list must be a list of caps in MiB, one per bucket (e.g. [1, 25]), got "
            f"{type(cap_list).__name__} {cap_list!r:.60}: for one cap for every bucket, pass bucket_cap_mb instead"
        )
    if len(cap_list) == 0:
        raise ConfigError(
            "bucket_cap_mb_list=[] holds no cap (torch takes it as not given): pass one cap in MiB per bucket, "
            "e.g. [1, 25], or leave it None and set bucket_cap_mb"
        )


def check_hook_signature(hook: object) -> None:
    """torch's ``_check_comm_hook`` checks the type; this also checks the hook takes ``(state, bucket)``, which would
    otherwise fail at the first bucket, deep inside backward."""
    if not callable(hook):
        raise TypeError(f"register_comm_hook: hook must be callable, got {type(hook).__name__}")
    try:
        inspect.signature(hook).bind(None, None)
    except TypeError:
        raise TypeError(
            f"register_comm_hook: hook {getattr(hook, '__qualname__', hook)!r} must take two arguments, "
            f"hook(state, bucket) -> torch.futures.Future[torch.Tensor]; its signature is {inspect.signature(hook)}"
        ) from None
    except ValueError:  # a builtin without a signature: nothing to check
        pass


@dataclasses.dataclass(frozen=True)
class Config:
    """What the reducer is built from, kept so an unpickled or copied model can build its own."""

    caps: BucketCaps
    check_desync: bool  # GRADSYNC_DEBUG's checks: every collective compared across ranks before it runs
    as_view: bool
    mode: GraphMode
    skip_unused: bool
    ignored: frozenset[str]  # torch's ignore list (set_params_and_buffers_to_ignore)
    sparse: frozenset[str]  # parameters of sparse embeddings: their gradients are reduced as sparse tensors
    delayed: frozenset[str] = frozenset()  # delay_all_reduce_named_params: averaged outside the reducer
    delay_hook: str | None = None  # param_to_hook_all_reduce's name: its gradient starts theirs

    @classmethod
    def of(
        cls,
        module: nn.Module,
        caps: tuple[float | str | None, Sequence[float] | None],
        switches: tuple[bool | None, bool | None],
        as_view: bool,
        find_unused: bool,
        static: bool,
        skip_unused: bool,
        delayed: tuple[frozenset[str], str | None] = (frozenset(), None),
    ) -> Config:
        """``caps``: (bucket_cap_mb, bucket_cap_mb_list); ``switches``: (bucket_tuning, check_desync), None for
        their environment defaults (``GRADSYNC_BUCKET_TUNING``, ``GRADSYNC_DEBUG``), read here and nowhere else."""
        if not isinstance(module, nn.Module):
            raise TypeError(f"gradsync.DistributedDataParallel wraps an nn.Module, got {type(module).__name__}")
        check_cap_list(caps[1])
        if not dist.is_available() or not dist.is_initialized():
            raise ConfigError(
                "DistributedDataParallel needs an initialised process group: call gradsync.init() or "
                "torch.distributed.init_process_group(...) before wrapping the model."
            )
        ignored = frozenset(getattr(module, torch_private.PARAMS_AND_BUFFERS_TO_IGNORE, ()))
        mode = GraphMode.from_flags(find_unused, static)
        tuning, check_desync = switches
        device = next((p.device.type for p in module.parameters() if p.requires_grad), "cpu")
        config = cls(
            BucketCaps.parse(*caps, tuning=tuning, device_type=device),
            settings.debug() if check_desync is None else check_desync,
            as_view,
            mode,
            skip_unused and find_unused,
            ignored,
            sparse_parameters(module),
            *delayed,
        )
        meta = [n for n, p in module.named_parameters() if p.device.type == "meta"]
        if meta:
            raise ConfigError(
                f"the module has parameters on the meta device ({', '.join(meta[:5])}): they hold no values to "
                "broadcast or average. Materialise them first (module.to_empty(device=...) and initialise)."
            )
        if not config.trainable(module) and not config.delayed:
            raise ConfigError(
                "DistributedDataParallel is not needed when a module doesn't have any parameter that requires a "
                "gradient (torch's words): there is nothing to synchronise. Wrap a module with trainable "
                "parameters, or do not wrap this one."
            )
        return config

    def trainable(self, module: nn.Module) -> list[tuple[str, nn.Parameter]]:
        """The parameters the reducer averages: those that require grad, neither ignored nor delayed."""
        excluded = self.ignored | self.delayed
        return [(n, p) for n, p in module.named_parameters() if p.requires_grad and n not in excluded]


def sparse_parameters(module: nn.Module) -> frozenset[str]:
    """Names of the parameters whose gradient is sparse (torch's rule: a sparse Embedding or EmbeddingBag)."""
    names: set[str] = set()
    for prefix, sub in module.named_modules():
        if isinstance(sub, (nn.Embedding, nn.EmbeddingBag)) and sub.sparse:
            names.update(f"{prefix}.{n}" if prefix else n for n, _ in sub.named_parameters(recurse=False))
    return frozenset(names)


def group_of(process_group: dist.ProcessGroup | None, device_mesh: Any) -> dist.ProcessGroup | None:
    if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(
            f"process_group must be a torch.distributed.ProcessGroup (from dist.new_group) or None for the default "
            f"group, got {type(process_group).__name__}"
        )
    if device_mesh is None:
        return process_group
    if process_group is not None:
        raise ConfigError("Cannot specify both process_group and device_mesh arguments (torch's rule).")
    if not hasattr(device_mesh, "get_group"):
        raise TypeError(
            f"device_mesh must be a torch.distributed.device_mesh.DeviceMesh (from init_device_mesh), got "
            f"{type(device_mesh).__name__}"
        )
    if device_mesh.ndim != 1:
        raise ConfigError(
            f"Only 1D device mesh is supported, but got {device_mesh} (torch's rule): pass the data-parallel "
            "dimension, e.g. device_mesh=mesh['dp'], and apply tensor parallelism over the others before wrapping."
        )
    return device_mesh.get_group(mesh_dim=0)


def warn_deprecated(broadcast_buffers: bool | None, forward_sync_buffers: bool | None, check_reduction: bool) -> None:
    """torch 2.13's FutureWarnings, in torch's words, so code that filters them keeps working."""
    if broadcast_buffers is not None and forward_sync_buffers is not None:
        warnings.warn(
            "Both `broadcast_buffers` and `forward_sync_buffers` were specified. `broadcast_buffers` is deprecated "
            "and its value is ignored when `forward_sync_buffers` is provided.",
            FutureWarning,
            stacklevel=3,
        )
    elif broadcast_buffers is not None:
        warnings.warn(
            "`broadcast_buffers` is deprecated. Use `forward_sync_buffers` instead. IMPORTANT: unlike "
            "`broadcast_buffers=False`, `forward_sync_buffers=False` still syncs buffers at init.",
            FutureWarning,
            stacklevel=3,
        )
    if check_reduction:
        warnings.warn(
            "The `check_reduction` argument in `DistributedDataParallel` module is deprecated. Please avoid using it.",
            FutureWarning,
            stacklevel=3,
        )


def buffer_sync_flags(broadcast_buffers: bool | None, forward_sync_buffers: bool | None) -> tuple[bool, bool]:
    """(sync buffers before each synced forward, sync them at construction). torch 2.13: ``forward_sync_buffers``
    replaces ``broadcast_buffers``, and only the old flag also skips the sync at construction."""
    if forward_sync_buffers is not None:
        return forward_sync_buffers, True
    synced = broadcast_buffers is None or bool(broadcast_buffers)
    return synced, synced


def device_indices(
    device_ids: Sequence[int | torch.device] | None, output_device: int | torch.device | None
) -> tuple[list[int] | None, int | None]:
    if isinstance(device_ids, (str, int, torch.device)):
        raise TypeError(f"device_ids must be a list of one device, e.g. device_ids=[local_rank], got {device_ids!r}")
    if device_ids is not None and len(device_ids) > 1:
        raise ConfigError(
            f"device_ids={list(device_ids)}: one process per device is supported (torch deprecated "
            "single-process multi-device); start one process per GPU and pass device_ids=[local_rank]."
        )
    ids = [device_index(d, "device_ids") for d in device_ids] if device_ids else None
    return ids, device_index(output_device, "output_device") if output_device is not None else None


def check_device_types(module: nn.Module, arguments: Mapping[str, Any]) -> None:
    """The module's parameters on one device, and a device named by type (``"cuda:0"``) where the module is: torch
    would move inputs there."""
    devices = sorted({str(p.device) for p in module.parameters() if p.requires_grad})
    if len(devices) > 1:
        # autograd runs each device's backward on a thread of its own, so the hooks of one backward would run on
        # several threads at once; gradsync's per-bucket counts assume one (torch refuses CPU with CUDA too).
        raise ConfigError(
            f"the module's trainable parameters are on several devices ({', '.join(devices)}); gradsync's DDP "
            "needs them on one: move the whole module to one device (module.to(device)) and run one process per "
            "device. Multi-device model parallelism inside one DDP process is not supported."
        )
    where = {p.device.type for p in module.parameters()}
    for argument, value in arguments.items():
        for device in value if isinstance(value, Sequence) and not isinstance(value, str) else [value]:
            kind = torch.device(device).type if isinstance(device, (str, torch.device)) else None
            if kind is not None and kind not in where:
                raise ConfigError(
                    f"{argument}={value!r} names a {kind} device but the module's parameters are on "
                    f"{', '.join(sorted(where))}: move the module first (module.to({str(device)!r})), then wrap it"
                )
    trained_on = {p.device.type for p in module.parameters() if p.requires_grad}
    if trained_on == {"cpu"} and any(arguments.values()):
        # torch's rule (DistributedDataParallel.__init__: "device_ids and output_device arguments only work with
        # single-device/multiple-device GPU modules or CPU modules"): a CPU module takes neither.
        given = ", ".join(f"{k}={v!r}" for k, v in arguments.items() if v)
        raise ConfigError(
            f"{given}: the module's parameters are on the CPU, and device_ids and output_device only work with a "
            "GPU module (torch's rule): drop them for a CPU module, or move the module to its GPU first "
            "(module.to(local_rank)) and pass device_ids=[local_rank]"
        )


def device_index(device: int | str | torch.device, argument: str) -> int:
    if isinstance(device, str):  # torch's _get_device_index takes "cuda:0" too
        try:
            device = torch.device(device)
        except RuntimeError:
            raise ConfigError(
                f"{argument}: {device!r} is not a device; pass an index or a device such as 'cuda:0' or "
                "torch.device('cuda', local_rank)"
            ) from None
    if isinstance(device, torch.device):
        if device.index is None:
            raise ConfigError(f"{argument}: device {device} has no index; pass e.g. torch.device('cuda', local_rank)")
        return device.index
    if not isinstance(device, int) or isinstance(device, bool):
        raise ConfigError(f"{argument}: expected a device index or device, got {device!r}")
    return device
