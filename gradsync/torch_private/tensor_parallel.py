"""torch.distributed.tensor's and FSDP's classes, as DDP's composition with tensor parallelism needs them: the
DTensor class (public from 2.5, ``torch.distributed._tensor`` before) and the classes of a module FSDP already
shards (``FSDPModule`` public from 2.6, under ``torch.distributed._composable.fsdp`` before).

Each is looked up among the modules this process has already imported, never imported here: no tensor is a DTensor,
and no module is sharded by FSDP, before the module defining that class is imported, and importing them costs a
second or more of every worker's start-up (torch.distributed.tensor pulls in sympy and DTensor's operator tables),
which a job without tensor parallelism or FSDP would pay for nothing.
"""

from __future__ import annotations

import sys


def _loaded_class(*dotted: str) -> type | None:
    for name in dotted:
        module, _, attr = name.rpartition(".")
        found = getattr(sys.modules.get(module), attr, None)
        if isinstance(found, type):
            return found
    return None


_dtensor: type | None = None  # once found (is_dtensor asks for every buffer at every forward): it stays the same


def dtensor_type() -> type | None:
    """torch's DTensor class, or None while it is not imported (``torch.distributed.tensor.DTensor``; in 2.4
    ``torch.distributed._tensor.DTensor``, which 2.13 still keeps as an alias)."""
    global _dtensor
    if _dtensor is None:
        _dtensor = _loaded_class("torch.distributed.tensor.DTensor", "torch.distributed._tensor.DTensor")
    return _dtensor


def fsdp_module_types() -> tuple[type, ...]:
    """The classes of a module FSDP shards, among those imported: FSDP2's ``FSDPModule`` (``fully_shard``; public
    in ``torch.distributed.fsdp`` from 2.6, ``torch.distributed._composable.fsdp`` before) and FSDP1's wrapper."""
    found = (
        _loaded_class("torch.distributed.fsdp.FSDPModule", "torch.distributed._composable.fsdp.FSDPModule"),
        _loaded_class("torch.distributed.fsdp.FullyShardedDataParallel"),
    )
    return tuple(t for t in found if t is not None)
