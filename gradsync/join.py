"""Uneven inputs: ranks that run out of data shadow the others' collectives with zeros, so nobody hangs.

Uses torch's generic join context manager (``torch.distributed.algorithms.join.Join``), as torch's DDP does: each
iteration the active ranks all-reduce a 1 before their first collective and joined ranks a 0; while any rank is
active, joined ranks repeat, in the same order, every collective of a training step: the one-time bucket rebuild,
the buffer broadcast, and each bucket's communication hook on a zero-filled bucket. The averages therefore count
only the active ranks' gradients, divided by the initial world size (torch's ``divide_by_initial_world_size=True``)
or by the number of active ranks. When everyone has joined, the last rank to join broadcasts its model so all
replicas end identical.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import JoinHook

from gradsync.replicas import broadcast_tensors

if TYPE_CHECKING:
    from gradsync.ddp import DistributedDataParallel


class DDPJoinHook(JoinHook):
    """What a joined rank does for gradsync's DDP in each iteration the others still train."""

    def __init__(self, ddp: DistributedDataParallel, divide_by_initial_world_size: bool) -> None:
        self.ddp = ddp
        ddp._divide_by_initial_world_size = divide_by_initial_world_size

    def main_hook(self) -> None:
        ddp, reducer = self.ddp, self.ddp.reducer
        reducer.rebuild_buckets_if_pending()  # the active ranks do it at their next forward
        if ddp._will_broadcast_buffers():
            broadcast_tensors(ddp._buffers_to_sync, ddp.process_group)
        futures = []
        for k, bucket in enumerate(reducer.buckets):
            zeros = torch.zeros_like(bucket.buffer)
            views = [zeros[o : o + v.numel()].view_as(v) for o, v in _offsets(bucket.views)]
            futures.append(reducer.reduce_async(k, zeros, views))
        shadow_usage = reducer.usage.reduced_this_step()
        if shadow_usage:  # nothing used here; the result still tells this rank (static_graph) what the others used
            reducer.usage.start(bytearray(len(reducer.params)), ddp.process_group, reducer.params[0].device)
        for fut in futures:
            fut.wait()
        if shadow_usage:
            reducer.usage.result()
        if not reducer.rebuilt and reducer.rebuild_allowed:
            # A rank that joined before its first synced backward still takes part in the others' one-time rebuild
            # (order, tuning probe, plan broadcast) at their next forward.
            reducer.request_rebuild()

    def post_hook(self, is_last_joiner: bool) -> None:
        # The last joiner trained longest; its model is everyone's model from here on.
        group = self.ddp.process_group
        candidate = torch.tensor([dist.get_rank(group) if is_last_joiner else -1], device=self.ddp.join_device)
        dist.all_reduce(candidate, op=dist.ReduceOp.MAX, group=group)
        src = dist.get_global_rank(group, int(candidate.item()))
        module = self.ddp.module
        broadcast_tensors([p.detach() for p in module.parameters()] + list(module.buffers()), group, src=src)


def _offsets(views: list[torch.Tensor]):
    offset = 0
    for v in views:
        yield offset, v
        offset += v.numel()
