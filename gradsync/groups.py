"""Process groups, passed explicitly (default: the world group) and never held longer than the caller holds them.

When no group is given, gradsync looks the default group up at each use instead of storing it, so a DDP object
that outlives ``destroy_process_group()`` does not keep the destroyed group (and gloo's worker threads) alive, and
a re-initialised default group is picked up. (The exit-time abort those threads can cause is handled in
``gradsync.runtime.env.release_backend_threads``.)
"""

from __future__ import annotations

import torch.distributed as dist


def resolve(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """``group``, or the current default (world) group when it is None."""
    if group is not None:
        return group
    world = dist.group.WORLD
    if world is None:
        raise RuntimeError("gradsync: the default process group is gone (destroyed, or never initialised).")
    return world


def rank0_global(group: dist.ProcessGroup | None) -> int:
    """Global rank of the group's rank 0 (the source of every broadcast)."""
    return dist.get_global_rank(resolve(group), 0)
