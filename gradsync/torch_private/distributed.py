"""torch.distributed's private names: the default group's store and group counter, a backend's timeout, setting a
formed group's timeout, DDP's first-bucket size, the class of the futures comm hooks return, and the device name a
custom accelerator registered (which ``gradsync run --nproc-per-node`` accepts, as torchrun does)."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from gradsync.torch_private.records import needed

_FUTURE: type = getattr(torch._C, "Future", torch.futures.Future)


def is_torch_future(obj: object) -> bool:
    """Whether ``obj`` is a torch future, ``.then()``'s result included (``torch._C.Future``; 2.4.0-2.13.0)."""
    return isinstance(obj, _FUTURE)


def privateuse1_backend_name() -> str:
    """The name a custom accelerator registered for the privateuse1 device
    (``torch._C._get_privateuse1_backend_name``; checked 2.4.0-2.13.0)."""
    read = getattr(torch._C, "_get_privateuse1_backend_name", None)
    return str(read()) if read is not None else "privateuseone"


def default_store() -> dist.Store:
    """The default process group's store; raises when there is none
    (``distributed_c10d._get_default_store``; checked 2.4.0-2.13.0)."""
    read = getattr(dist.distributed_c10d, "_get_default_store", None)
    if read is None:
        raise needed("torch.distributed.distributed_c10d._get_default_store")
    return read()


def reset_group_count() -> None:
    """Reset torch's count of groups made, as ``destroy_process_group`` does, after an init that failed
    (``distributed_c10d._world.group_count``; checked 2.4.0-2.13.0)."""
    world = getattr(dist.distributed_c10d, "_world", None)
    if world is None or not hasattr(world, "group_count"):
        raise needed("torch.distributed.distributed_c10d._world.group_count")
    world.group_count = 0


def group_timeout_settable() -> bool:
    """Whether :func:`set_group_timeout` works in this torch: run in 2.13.0 (tests/test_torch_private.py: a gloo
    collective outlives the timeout the group formed with). Not before: torch 2.9 gave gloo per-operation timeouts
    (pytorch/pytorch#158128), after which its operations ignored a timeout set later until pytorch/pytorch#167052."""
    return hasattr(dist.distributed_c10d, "_set_pg_timeout") and torch.__version__ >= "2.13"


def set_group_timeout(seconds: float) -> None:
    """Set the default group's collective timeout after it formed, where :func:`group_timeout_settable`
    (``distributed_c10d._set_pg_timeout``; run in 2.13.0)."""
    dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=seconds))


def backend_timeout_seconds(group: dist.ProcessGroup, device: torch.device) -> float | None:
    """The collective timeout of ``group``'s backend for ``device``, or None where there is no such backend or it
    does not say (``ProcessGroup._get_backend(device).options._timeout``; checked 2.4.0-2.13.0)."""
    try:
        return float(group._get_backend(device).options._timeout.total_seconds())
    except Exception:  # no backend for this device, or one without options
        return None


def first_bucket_bytes() -> int | None:
    """torch DDP's first-bucket size, or None where torch no longer says
    (``dist._DEFAULT_FIRST_BUCKET_BYTES``; checked 2.4.0-2.13.0)."""
    value = getattr(dist, "_DEFAULT_FIRST_BUCKET_BYTES", None)
    return int(value) if value is not None else None
