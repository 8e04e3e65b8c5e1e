"""The reference reducer: after backward, one blocking all-reduce per gradient. Slow, and obviously correct.

Tests check the fast :class:`~gradsync.reducer.reducer.Reducer` against it (picotron's naive class silently broke
because nothing tested it; this one is tested against a single-process run too).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from gradsync.collectives.communicator import Communicator, Op


def average_gradients(params: Iterable[torch.nn.Parameter], process_group: dist.ProcessGroup | None = None) -> None:
    """Replace each ``param.grad`` by its average over ``process_group``; call after ``backward()``.

    A parameter without a gradient counts as zeros; if no rank has a gradient for it, its ``.grad`` stays ``None``
    (the semantics of torch's DDP with ``find_unused_parameters=True``).

    >>> loss.backward(); average_gradients(model.parameters()); optimizer.step()  # doctest: +SKIP
    """
    comm = Communicator(process_group)
    params = [p for p in params if p.requires_grad]
    has_grad = torch.tensor([p.grad is not None for p in params], dtype=torch.int32)
    comm.all_reduce(Op.USAGE_ALLREDUCE, has_grad)
    for k, (p, anyone) in enumerate(zip(params, has_grad.tolist())):
        if not anyone:
            continue
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        grad.mul_(1.0 / comm.size)  # torch's C++ reducer multiplies by the reciprocal too
        comm.all_reduce(Op.BUCKET_ALLREDUCE, grad, index=k)
        p.grad = grad
