"""How many tensors share a storage (``torch._C._storage_Use_Count``): the reducer lends a bucket's memory to
``.grad`` only while it can tell that nothing else holds it (:mod:`gradsync.reducer.lending`).

In CPU builds before 2.5 the name was registered with CUDA's module only (pytorch/pytorch#131881), so it may be
missing: then nothing is lent, and averages are copied back into ``.grad`` as torch's reducer does."""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

_USE_COUNT: Callable[[int], int] | None = getattr(torch._C, "_storage_Use_Count", None)


def storage_use_count(tensor: torch.Tensor) -> int:
    """The number of references to ``tensor``'s storage (each tensor on it, and its Python storage object);
    ``torch._C._storage_Use_Count``, checked 2.13.0. Call :func:`can_count_storage_uses` first."""
    assert _USE_COUNT is not None
    return _USE_COUNT(tensor.untyped_storage()._cdata)


def can_count_storage_uses() -> bool:
    return _USE_COUNT is not None


def _holders(tensor: torch.Tensor) -> tuple[int, int]:
    """Who holds ``tensor``'s memory: the storage's use count, and the Python references to its storage object
    (this function's own included)."""
    assert _USE_COUNT is not None
    storage = tensor.untyped_storage()
    return _USE_COUNT(storage._cdata), sys.getrefcount(storage)


# Calibrated, not assumed: what a storage that one tensor alone holds counts in this torch.
_SOLE = _holders(torch.empty(1)) if _USE_COUNT is not None else None


def held_by_it_alone(tensor: torch.Tensor) -> bool:
    """Whether nothing but ``tensor`` holds its memory: no other tensor (a view, a base it was cut from) and no
    Python handle on its storage. The caller holds ``tensor`` itself, so its Python references do not matter."""
    return _SOLE is not None and _holders(tensor) == _SOLE
