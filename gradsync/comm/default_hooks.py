"""The default communication hook: average a bucket with one asynchronous all-reduce.

Matches ``torch.distributed.algorithms.ddp_comm_hooks.default_hooks.allreduce_hook``: divide by the world size
first, then sum, so results agree with torch's DDP bit for bit.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from gradsync.collectives.groups import resolve
from gradsync.comm.grad_bucket import GradBucket


def allreduce_hook(process_group: dist.ProcessGroup | None, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket.buffer()`` across ``process_group`` (default: the world group).

    >>> ddp.register_comm_hook(None, allreduce_hook)  # doctest: +SKIP
    """
    group = resolve(process_group)
    tensor = bucket.buffer()
    tensor.div_(group.size())
    work = dist.all_reduce(tensor, group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])
