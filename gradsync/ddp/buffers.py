"""Module buffers (BatchNorm statistics, counters): which are broadcast from rank 0 before a forward, and when.

torch's rule, matched here: at a forward, buffers are broadcast if the *previous* forward was a synced one (grad
enabled, not under no_sync), whatever this forward's grad mode. So an eval or no_grad forward right after a
training step sees rank 0's statistics, and the micro-batches of a no_sync accumulation do not broadcast again.
The buffer list is read anew each time, because a module may reassign a buffer after wrapping
(``self.buf = self.buf + 1``; pytorch/pytorch#63916); buffers on torch's ignore list are left alone.
"""

from __future__ import annotations

from collections.abc import Collection

import torch
from torch import nn

from gradsync.collectives.communicator import Communicator, Op
from gradsync.collectives.tensors import broadcast_tensors
from gradsync.reducer.local_params import local_of


class BufferSync:
    """Broadcasts ``module``'s buffers (except ``ignored`` names) from rank 0 when torch would."""

    def __init__(self, module: nn.Module, comm: Communicator, ignored: Collection[str]) -> None:
        self._module = module
        self._comm = comm
        self._ignored = set(ignored)

    def buffers(self) -> list[torch.Tensor]:
        # A DTensor buffer's local values: the data-parallel peers hold the same shard of it.
        return [local_of(b) for name, b in self._module.named_buffers() if name not in self._ignored]

    def due(self, enabled: bool, previous_forward_synced: bool) -> bool:
        """Whether this forward broadcasts: ``enabled`` is the model's forward_sync_buffers, and the previous forward
        must have been a synced one (torch's require_forward_param_sync)."""
        return enabled and previous_forward_synced and self._comm.size > 1 and bool(self.buffers())

    def broadcast(self) -> None:
        broadcast_tensors(self._comm, Op.BUFFER_BROADCAST, self.buffers())
