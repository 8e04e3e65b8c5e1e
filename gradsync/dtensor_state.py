"""Tensor-parallel DTensors in gradsync's checkpoints. :func:`gradsync.checkpoint.save` writes rank 0's copy of the
state, which is every rank's for plain data parallelism but only rank 0's shards for a DTensor. So each DTensor is
saved whole (gathered over its mesh, every rank taking part), and at restore it is split again to the placements of
the model or optimizer restored into. A checkpoint thus loads at any tensor-parallel size, or into a plain model.
The layout check below catches ranks whose state differs (pipeline stages), which one file cannot hold."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch

from gradsync.ddp.tree import iter_tensors, map_tensors
from gradsync.reducer.local_params import is_dtensor


def holds_dtensors(state: Any) -> bool:
    """Whether any tensor inside ``state`` (nested dicts, lists, tuples) is a DTensor."""
    return any(is_dtensor(t) for t in iter_tensors(state))


def whole(state: Any) -> Any:
    """``state`` with every DTensor replaced by its full tensor: a collective over the DTensor's mesh, so every rank
    calls this with the same layout (:func:`layout`), in the same order."""
    return map_tensors(lambda t: t.full_tensor() if is_dtensor(t) else t, state)


def layout(module_state: Mapping[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """A module's state dict as names and global shapes: the same on every data-parallel replica."""
    return [(name, tuple(t.shape)) for name, t in module_state.items() if isinstance(t, torch.Tensor)]


def _split_like(saved: torch.Tensor, like: Any) -> torch.Tensor:
    """``saved`` (a full tensor) as a DTensor of ``like``'s mesh and placements."""
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(saved.to(like.to_local().device), like.device_mesh, like.placements)


def module_state_for(current: Mapping[str, Any], saved: Mapping[str, Any]) -> dict[str, Any]:
    """``saved`` with each entry that is a DTensor in the module's ``current`` state dict split to that DTensor's
    placements; the version metadata ``load_state_dict`` reads (``_metadata``) is kept, as torch's copy keeps it."""
    placed = OrderedDict(
        (name, _split_like(value, current[name]) if is_dtensor(current.get(name)) and _is_whole(value) else value)
        for name, value in saved.items()
    )
    metadata = getattr(saved, "_metadata", None)
    if metadata is not None:
        placed._metadata = metadata  # type: ignore[attr-defined]
    return placed


def _is_whole(value: Any) -> bool:
    """A saved plain tensor, as :func:`whole` writes a DTensor (one already placed is left as it is)."""
    return isinstance(value, torch.Tensor) and not is_dtensor(value)


def optimizer_state_for(optimizer: torch.optim.Optimizer, saved: Mapping[str, Any]) -> dict[str, Any]:
    """``saved`` (an optimizer state dict) with each per-parameter tensor of a DTensor parameter's shape split to that
    parameter's placements (momentum, Adam's moments); scalars such as ``step`` stay as they are."""
    ids = [i for group in saved["param_groups"] for i in group["params"]]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    by_id = dict(zip(ids, params))
    state = {}
    for i, entries in saved["state"].items():
        p = by_id.get(i)
        if p is None or not is_dtensor(p):
            state[i] = entries
            continue
        state[i] = {k: _split_like(v, p) if _is_whole(v) and v.shape == p.shape else v for k, v in entries.items()}
    return {**saved, "state": state}
