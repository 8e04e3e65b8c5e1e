"""Process groups, passed explicitly (default: the world group) and never held longer than the caller holds them.

When no group is given, gradsync looks the default group up at each use instead of storing it, so a DDP object
that outlives ``destroy_process_group()`` does not keep the destroyed group (and gloo's worker threads) alive, and
a re-initialised default group is picked up. The exit-time abort those threads can cause is handled by
:func:`release_backend_threads`, registered at exit when gradsync is imported.
"""

from __future__ import annotations

import atexit
import os
import time

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


def _gloo_threads_alive() -> bool:
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return True  # cannot tell (not Linux): be safe
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as fh:
                if fh.read().startswith("pt_gloo"):
                    return True
        except OSError:
            continue
    return False


def release_backend_threads(seconds: float = 0.1) -> None:
    """Give gloo's worker threads the GIL for a moment before the interpreter finalises.

    A gloo worker thread destroys each finished work, and with it the last reference to tensors whose Python objects
    torch keeps alive (``all_gather_object``'s temporaries): that needs the GIL. If the interpreter is already
    finalising, taking the GIL exits the thread through a ``noexcept`` frame and the process aborts with "terminate
    called without an active exception" (also in scripts that never call gradsync.init, as Lightning's and Fabric's;
    torch keeps the group alive past ``destroy_process_group`` once ``torch._dynamo`` is imported, which any
    optimizer does). Sleeping here releases the GIL while the interpreter can still serve them. Registered at exit
    when gradsync is imported, so scripts that set up their group themselves (Lightning, Accelerate, torchrun) are
    covered too.
    """
    if _gloo_threads_alive():
        time.sleep(seconds)


atexit.register(release_backend_threads)
