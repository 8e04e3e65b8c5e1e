"""torch's foreach kernels: many tensors copied or scaled in one kernel launch, one call per tensor where they are
gone (``torch._foreach_copy_``, ``torch._foreach_mul_``; checked 2.4.0-2.13.0)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def _copy_each(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
    for dst, src in zip(dsts, srcs):
        dst.copy_(src)


def _mul_each(tensors: Sequence[torch.Tensor], scalar: float) -> None:
    for tensor in tensors:
        tensor.mul_(scalar)


_FOREACH_COPY: Callable[..., None] = getattr(torch, "_foreach_copy_", _copy_each)
_FOREACH_MUL: Callable[..., None] = getattr(torch, "_foreach_mul_", _mul_each)


def foreach_copy_(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
    """``dst.copy_(src)`` for each pair (lists or tuples) in one kernel launch (``torch._foreach_copy_``; checked
    2.4.0-2.13.0)."""
    _FOREACH_COPY(dsts, srcs)


def foreach_mul_(tensors: Sequence[torch.Tensor], scalar: float) -> None:
    """``t.mul_(scalar)`` for each tensor (a list or tuple) in one kernel launch (``torch._foreach_mul_``; checked
    2.4.0-2.13.0)."""
    _FOREACH_MUL(tensors, scalar)
