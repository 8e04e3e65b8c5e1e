"""Find and map tensors inside arbitrary forward inputs and outputs.

A model may return tensors in dicts, lists, tuples, namedtuples or dataclasses; DDP must see through all of them
(to search the autograd graph, or to move inputs to ``device_ids[0]``) without changing the structure.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Yield every tensor inside ``obj``, depth first."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from iter_tensors(value)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for value in obj:
            yield from iter_tensors(value)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            yield from iter_tensors(getattr(obj, field.name))


def map_tensors(fn: Callable[[Any], Any], obj: Any, units: tuple[type, ...] = ()) -> Any:
    """Return ``obj`` with ``fn`` applied to every tensor, keeping containers' types. Objects of a type in ``units``
    are given to ``fn`` whole instead of being looked into."""
    if isinstance(obj, torch.Tensor) or (units and isinstance(obj, units)):
        return fn(obj)
    if isinstance(obj, dict):
        out = copy.copy(obj)  # keeps OrderedDict and dict subclasses such as model-output classes
        for key, value in obj.items():
            out[key] = map_tensors(fn, value, units)
        return out
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(map_tensors(fn, v, units) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(fn, v, units) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        duplicate = copy.copy(obj)
        for field in dataclasses.fields(obj):
            object.__setattr__(duplicate, field.name, map_tensors(fn, getattr(obj, field.name), units))
        return duplicate
    return obj


def to_device(obj: Any, device: torch.device) -> Any:
    """``obj`` with every tensor on ``device`` (``device_ids``), as torch's DDP moves inputs: a PackedSequence as
    one unit (its ``batch_sizes`` must stay on the CPU, which its own ``.to`` keeps), and each copy blocking, so a
    pinned buffer the caller reuses for the next batch cannot be overwritten while it is still being read."""
    from torch.nn.utils.rnn import PackedSequence

    return map_tensors(lambda t: t.to(device), obj, units=(PackedSequence,))


def replace_tensors(obj: Any, transform: Callable[[list[torch.Tensor]], list[torch.Tensor]]) -> Any:
    """``obj`` with its tensors, collected in :func:`map_tensors`'s order, replaced by ``transform(tensors)``."""
    found: list[torch.Tensor] = []

    def collect(t: torch.Tensor) -> torch.Tensor:
        found.append(t)
        return t

    map_tensors(collect, obj)
    if not found:
        return obj
    replaced = iter(transform(found))
    return map_tensors(lambda _t: next(replaced), obj)
