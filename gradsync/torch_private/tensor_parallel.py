"""torch.distributed.tensor's and FSDP's classes, as DDP's composition with tensor parallelism needs them: the
DTensor class (public from 2.5, ``torch.distributed._tensor`` before) and the classes of a module FSDP already
shards (``FSDPModule`` public from 2.6, under ``torch.distributed._composable.fsdp`` before)."""

from __future__ import annotations

import importlib


def _first_class(*dotted: str) -> type | None:
    for name in dotted:
        module, _, attr = name.rpartition(".")
        try:
            return getattr(importlib.import_module(module), attr)  # type: ignore[no-any-return]
        except (ImportError, AttributeError):
            continue
    return None


def dtensor_type() -> type | None:
    """torch's DTensor class, or None where this torch has none (``torch.distributed.tensor.DTensor``; in 2.4
    ``torch.distributed._tensor.DTensor``, which 2.13 still keeps as an alias)."""
    return _first_class("torch.distributed.tensor.DTensor", "torch.distributed._tensor.DTensor")


def fsdp_module_types() -> tuple[type, ...]:
    """The classes of a module FSDP shards: FSDP2's ``FSDPModule`` (``fully_shard``; public in
    ``torch.distributed.fsdp`` from 2.6, ``torch.distributed._composable.fsdp`` before) and FSDP1's wrapper."""
    found = (
        _first_class("torch.distributed.fsdp.FSDPModule", "torch.distributed._composable.fsdp.FSDPModule"),
        _first_class("torch.distributed.fsdp.FullyShardedDataParallel"),
    )
    return tuple(t for t in found if t is not None)
