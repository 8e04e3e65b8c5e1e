"""Write-back by lending: a large gradient's averages reach ``.grad`` by pointing ``.grad`` at its bucket slot, not
by copying them back, wherever nobody can tell the difference.

torch's C++ reducer (``gradient_as_bucket_view=False``) copies every averaged slot back into ``.grad``
(``Reducer::finalize_bucket_dense``): after the copy into the bucket, a second pass over every gradient byte. In the
usual loop, ``zero_grad()`` sets gradients to None (its default since torch 2.0), so each backward's ``.grad`` is a
fresh tensor that nothing else holds. Then ``grad.set_(slot)`` gives the same tensor object the same values with no
copy: the slot is lent to it.

A lent slot is the user's until they let go of it. Before the next synced backward writes into the buckets, their
storage must be held by nothing but the reducer's own views: its use count, and the Python references to its
storage object, back at the baseline measured before anything was lent. If a gradient, a view, a DLPack export or
the storage object of one is still held (``zero_grad(set_to_none=False)``, gradients kept across steps, no_sync
accumulating into the last step's), the buckets move to a storage of their own, once, and
averages are copied back from then on: torch's behaviour and torch's cost. Nothing is lent where the values could
differ from torch's: gradient_as_bucket_view (``.grad`` is the slot already), a gradient that anything but its
parameter holds, or whose memory anything else holds
(:func:`~gradsync.torch_private.storage.gradient_held_by_its_parameter_alone`: a Python reference, a view, a NumPy
array, a DLPack export, its storage object, shared or pinned memory), one that needs autograd
(``create_graph=True``), a tensor subclass, or a layout other than the slot's. ``grad.set_(slot)`` lets go of the
gradient's own memory, so anything that still read it would read freed memory: only what cannot be detected (a raw
``data_ptr()`` an extension keeps, a CUDA graph that captured the address) is left, and docs/migrating.md says to
turn lending off (``GRADSYNC_LENDING=0``) there.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import torch

from gradsync.torch_private.storage import (
    calibrate,
    can_count_storage_uses,
    gradient_held_by_its_parameter_alone,
    storage_holders,
)


class Verdict(enum.Enum):
    LEND = "the buckets' storage is free: this step lends its large slots to .grad"
    COPY = "averages are copied back (before the rebuild, gradient_as_bucket_view, or after a move)"
    MOVE = "a lent slot is still held: the buckets move to a storage of their own, and copy back from now on"


class Lending:
    """One reducer's lending: the baseline its buckets' storage counts with nothing lent, and whether it has
    given up (a loan still held once). ``enabled=False`` (``GRADSYNC_LENDING=0``) copies back from the start."""

    def __init__(self, enabled: bool = True) -> None:
        self._baseline: list[tuple[int, int]] | None = None
        self._gave_up = not enabled or not can_count_storage_uses()
        if not self._gave_up:
            calibrate()

    def before_step(self, storage: Sequence[torch.Tensor]) -> Verdict:
        """Before a synced backward writes into ``storage`` (the final layout's, after the rebuild): lend again,
        or move off a storage that someone still holds."""
        if self._gave_up or not storage:
            return Verdict.COPY
        uses = [storage_holders(t) for t in storage]
        if self._baseline is None:
            self._baseline = uses  # nothing was lent from this storage yet: the reducer's own views alone
            return Verdict.LEND
        if uses == self._baseline:
            return Verdict.LEND
        self._gave_up = True
        return Verdict.MOVE


def lend(params: Sequence[torch.Tensor], slots: Sequence[torch.Tensor]) -> None:
    """Each parameter's ``.grad`` gets its averaged slot: lent where the gradient and its memory are the parameter's
    alone and its layout the slot's, copied otherwise (torch's copy, seen by every alias). Holds no reference to a
    gradient while it asks who holds it."""
    for param, slot in zip(params, slots):
        if _lendable(param):
            param.grad.set_(slot)  # type: ignore[union-attr, call-overload]
        else:
            param.grad.copy_(slot)  # type: ignore[union-attr]


def _lendable(param: torch.Tensor) -> bool:
    grad = param.grad
    plain = type(grad) is torch.Tensor and not grad.requires_grad and grad.is_contiguous()
    del grad  # counted by who holds it, below
    return plain and gradient_held_by_its_parameter_alone(param)
