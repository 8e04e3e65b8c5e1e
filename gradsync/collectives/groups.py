"""Process groups, passed explicitly (default: the world group) and never held longer than the caller holds them.

When no group is given, gradsync looks the default group up at each use instead of storing it, so a DDP object
that outlives ``destroy_process_group()`` does not keep the destroyed group (and gloo's worker threads) alive, and
a re-initialised default group is picked up. (The exit-time abort those threads can cause is handled in
``gradsync.runtime.env.release_backend_threads``.)
"""

from __future__ import annotations

import torch.distributed as dist

from gradsync.errors import ConfigError


def resolve(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """``group``, or the current default (world) group when it is None."""
    if group is not None:
        return group
    world = dist.group.WORLD
    if world is None:
        raise ConfigError(
            "the default process group is gone (destroyed, or never initialised): call gradsync.init() or "
            "torch.distributed.init_process_group(...) first, or pass process_group= explicitly."
        )
    return world
