"""Tell the other ranks why this one failed, through the process group's key-value store.

A rank that raises leaves its peers blocked in a collective until the process-group timeout, and the error they
then get ("Connection closed by peer", "Timed out waiting") says nothing of the cause. Posting the real reason to
the store lets each survivor name the rank that failed and why. :mod:`gradsync.collectives.communicator` posts
and reads these reports around every collective it issues.
"""

from __future__ import annotations

import time

import torch.distributed as dist

_PREFIX = "gradsync/error/"
_STEP_PREFIX = "gradsync/step/"


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


def post_step(step: int) -> None:
    """Record the synced step this rank is in (GRADSYNC_DEBUG), so that a rank's error can say how far a silent
    peer got: each rank numbers its own steps, so a skipped step shows only as a peer that stopped one step short."""
    store = _store()
    if store is None:
        return
    try:
        store.set(f"{_STEP_PREFIX}{dist.get_rank()}", str(step))
    except Exception:
        pass


def _steps_of(ranks: list[int]) -> dict[int, int]:
    store = _store()
    found: dict[int, int] = {}
    if store is None:
        return found
    try:
        for rank in ranks:
            key = f"{_STEP_PREFIX}{rank}"
            if store.check([key]):
                found[rank] = int(store.get(key))
    except Exception:
        pass
    return found


def peer_errors() -> dict[int, str] | None:
    """The failures other ranks have posted so far, by global rank; None if the store cannot be reached (it lives
    with rank 0, which may be the rank that died)."""
    store = _store()
    if store is None:
        return None
    found: dict[int, str] = {}
    try:
        for rank in range(dist.get_world_size()):
            key = f"{_PREFIX}{rank}"
            if rank != dist.get_rank() and store.check([key]):
                found[rank] = store.get(key).decode(errors="replace")
    except Exception:
        return None
    return found


def describe_peer_errors(grace: float = 0.0, collective: str | None = None, step: int | None = None) -> str:
    """Lines to append to an error message: what the other ranks reported and, after waiting up to ``grace``
    seconds for their reports, which ranks said nothing. Those never reached the failed collective (stuck before
    it, or dead): usually the ones to look at. ``collective``: what this rank was in; a peer that failed in another
    one means the ranks were out of step. ``step``: this rank's synced step, when steps are posted (GRADSYNC_DEBUG);
    a silent peer that posted another one stopped short or ran ahead."""
    deadline = time.monotonic() + grace
    errors = peer_errors()
    while errors is not None and len(errors) < dist.get_world_size() - 1 and time.monotonic() < deadline:
        time.sleep(0.1)
        errors = peer_errors()
    if errors is None:
        return "\n  (the other ranks' reports are unreachable: the store lives with rank 0)"
    text = "".join(f"\n  rank {rank} reported: {msg}" for rank, msg in sorted(errors.items()))
    elsewhere = sorted(r for r, msg in errors.items() if collective and not msg.startswith(collective + " failed"))
    if elsewhere and "failed on rank" in " ".join(errors[r] for r in elsewhere):
        text += (
            f"\n  rank(s) {elsewhere} failed in another collective than this rank: the ranks are out of step (one "
            "skipped or added a forward or backward, or took a data-dependent no_sync). Rerun with "
            "GRADSYNC_DEBUG=1 to name the first collective where they part."
        )
    silent = [r for r in range(dist.get_world_size()) if r != dist.get_rank() and r not in errors]
    if grace and silent:
        text += (
            f"\n  rank(s) {silent} reported nothing within {grace:.0f}s: they never reached this collective "
            "(stuck before it: a hang, slow data loading, an error swallowed elsewhere), died, or finished "
            "training early: with a different number of batches per rank, train inside `with ddp.join():`."
        )
    behind = {r: k for r, k in _steps_of(silent).items() if step is not None and k != step} if grace else {}
    if behind:
        listed = ", ".join(f"rank {r} at synced step {k}" for r, k in sorted(behind.items()))
        text += (
            f"\n  {listed}, this rank at step {step}: the ranks ran different numbers of synced steps (a step "
            "skipped on some ranks, or fewer batches there)."
        )
    return text
