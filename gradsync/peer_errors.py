"""Tell the other ranks why this one failed, through the process group's key-value store.

A rank that raises leaves its peers blocked in a collective until the process-group timeout, and the error they
then get ("Connection closed by peer", "Timed out waiting") says nothing of the cause. Posting the real reason to
the store lets each survivor name the rank that failed and why (DESIGN.md: errors name the rank and say what to do).
"""

from __future__ import annotations

import torch.distributed as dist

_PREFIX = "gradsync/error/"


def _store() -> dist.Store | None:
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # no default group, or its store is gone with rank 0
        return None


def post_error(message: str) -> None:
    """Record ``message`` as this rank's failure; never raises (it runs while an error is already in flight)."""
    store = _store()
    if store is None:
        return
    try:
        store.set(f"{_PREFIX}{dist.get_rank()}", message)
    except Exception:
        pass


def peer_errors() -> dict[int, str]:
    """The failures other ranks have posted so far, by global rank (empty if none or the store is unreachable)."""
    store = _store()
    if store is None:
        return {}
    found: dict[int, str] = {}
    try:
        for rank in range(dist.get_world_size()):
            key = f"{_PREFIX}{rank}"
            if rank != dist.get_rank() and store.check([key]):
                found[rank] = store.get(key).decode(errors="replace")
    except Exception:
        pass
    return found


def describe_peer_errors() -> str:
    """A sentence to append to an error message, or '' when no peer has reported."""
    errors = peer_errors()
    return "".join(f"\n  rank {rank} reported: {msg}" for rank, msg in sorted(errors.items()))
