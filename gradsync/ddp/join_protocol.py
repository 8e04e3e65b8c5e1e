"""Uneven inputs: torch's Join protocol for gradsync's DistributedDataParallel.

Both sides of it live here. A rank still training tells the joined ranks, at each forward, that it trains and which
collectives this forward issues (:meth:`JoinProtocol.notify`); a rank out of data answers them with the same
collectives and zeros for gradients (:meth:`JoinProtocol.shadow_forward_and_backward`, through
:class:`ForwardCollectives` and the reducer's shadow backward), then adopts the last joiner's model. torch's
``Join`` needs the model itself to be the ``Joinable`` (``join_hook``, ``join_device``, ``join_process_group``): it
keeps those methods and delegates here.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from gradsync.collectives.communicator import Communicator, Op
from gradsync.collectives.tensors import broadcast_tensors
from gradsync.ddp.forward_collectives import ForwardCollectives
from gradsync.ddp.join import NamedJoin
from gradsync.reducer.reducer import Reducer


class JoinProtocol:
    """What ``ddp.join()`` does on each side, for the ``joinable`` model (torch's Join reads its join config)."""

    def __init__(
        self,
        joinable: Joinable,
        comm: Communicator,
        collectives: ForwardCollectives,
        reducer: Reducer,
        module: nn.Module,
        ignored: Collection[str],  # parameters and buffers kept out of DDP: not part of the final model's sync
    ) -> None:
        self._joinable = joinable
        self._comm = comm
        self._collectives = collectives
        self._reducer = reducer
        self._module = module
        self._ignored = ignored
        self._divides_by_initial_world_size = True

    def context(self, enable: bool, throw_on_early_termination: bool, divide_by_initial_world_size: bool) -> Join:
        """The context manager ``ddp.join()`` returns: torch's ``Join`` with a joined rank's failure named."""
        return NamedJoin(
            [self._joinable],
            enable,
            throw_on_early_termination,
            divide_by_initial_world_size=divide_by_initial_world_size,
            comm=self._comm,
        )

    def hook(self, **kwargs: Any) -> JoinHook:
        """torch's ``join_hook``: called when a ``Join`` is made, with its keyword arguments."""
        self._divides_by_initial_world_size = kwargs.get("divide_by_initial_world_size", True)
        return DDPJoinHook(self)

    def notify(self, synced: bool, broadcast: bool) -> float:
        """Inside ``join()``: tell the joined ranks this one still trains (their loop waits on torch's Join
        all-reduce) and which collectives this forward issues, so they shadow exactly those. Returns what the
        averages must be multiplied by (divide_by_initial_world_size=False: world size / ranks still training)."""
        work = Join.notify_join_context(self._joinable)
        if work is None:
            return 1.0
        flags = torch.tensor([int(synced), int(broadcast)], device=self._joinable.join_device)
        self._comm.all_reduce(Op.JOIN_FLAGS, flags, reduce_op=dist.ReduceOp.MAX)
        if not synced or self._divides_by_initial_world_size:
            return 1.0
        work.wait()
        active = work.result()[0].item()
        return self._comm.size / active

    def shadow_forward_and_backward(self) -> None:
        """A joined rank, while others still train: the collectives of their forward and, if it synchronises,
        of their backward, with zeros for gradients. The same methods a training rank runs, so the sequences match
        by construction (GRADSYNC_DEBUG fingerprints included)."""
        flags = torch.zeros(2, dtype=torch.int64, device=self._joinable.join_device)
        self._comm.all_reduce(Op.JOIN_FLAGS, flags, reduce_op=dist.ReduceOp.MAX)
        synced, broadcast = (bool(v) for v in flags.tolist())
        self._collectives.issue(synced, broadcast)
        if synced:
            self._reducer.shadow_backward()

    def sync_final_model(self, is_last_joiner: bool) -> None:
        """After everyone joined: the last joiner trained longest, so its model becomes everyone's."""
        candidate = torch.tensor([self._comm.rank if is_last_joiner else -1], device=self._joinable.join_device)
        self._comm.all_reduce(Op.LAST_JOINER, candidate, reduce_op=dist.ReduceOp.MAX)
        ignored = self._ignored
        state = [p.detach() for n, p in self._module.named_parameters() if n not in ignored]
        state += [b for n, b in self._module.named_buffers() if n not in ignored]
        broadcast_tensors(self._comm, Op.FINAL_MODEL, state, src=int(candidate.item()))


class DDPJoinHook(JoinHook):
    """What a joined rank does for gradsync's DDP (torch's Join calls it): shadow each step, then adopt the final
    model. The logic lives next to what it shadows, in :class:`JoinProtocol` and the reducer."""

    def __init__(self, protocol: JoinProtocol) -> None:
        self.protocol = protocol

    def main_hook(self) -> None:
        self.protocol.shadow_forward_and_backward()

    def post_hook(self, is_last_joiner: bool) -> None:
        self.protocol.sync_final_model(is_last_joiner)
