"""Tell the other ranks why this one failed, through the process group's key-value store.

A rank that raises leaves its peers blocked in a collective until the process-group timeout, and the error they
then get ("Connection closed by peer", "Timed out waiting") says nothing of the cause. Posting the real reason to
the store lets each survivor name the rank that failed and why. :mod:`gradsync.collectives.communicator` posts
and reads these reports around every collective it issues.
"""

from __future__ import annotations

import torch.distributed as dist

from gradsync import torch_private
from gradsync.polling import wait_until

_PREFIX = "gradsync/error/"
_STEP_PREFIX = "gradsync/step/"
_NOT_AWAITED = "gradsync/reports-not-awaited"  # set in a group whose members recover from a failure themselves


def _store() -> dist.Store | None:
    try:
        return torch_private.default_store()
    except Exception:  # no default group, or its store is gone with rank 0
        return None


def post_error(message: str) -> None:
    """Record ``message`` as this rank's failure; never raises (it runs while an error is already in flight)."""
    store = _store()
    if store is not None:
        post_error_for(store, dist.get_rank(), message)


def post_error_for(store: dist.Store, rank: int, message: str) -> None:
    """Record ``message`` as the failure of ``rank`` in the group whose store is ``store``. Never raises."""
    try:
        store.set(f"{_PREFIX}{rank}", message)
    except Exception:
        pass


def recovered_by_members(store: dist.Store) -> None:
    """Say in ``store``, a group's, that its members recover from a failed collective themselves (gradsync.elastic's
    rounds: the next round's leader learns who is gone from the launchers' reports and the heartbeats), so that a
    rank whose collective failed waits for no peer's report. The wait only names the cause in the error, which the
    elastic job logs and goes on; it would hold up every survivor's recovery by :func:`report_grace` (in full on
    each host lost whole, whose launcher is gone with it and posts nothing), and keep the survivor's group open
    meanwhile, so the members waiting on it would fail no sooner either."""
    store.set(_NOT_AWAITED, "1")


def _reports_awaited() -> bool:
    store = _store()
    if store is None:
        return False
    try:
        return not store.check([_NOT_AWAITED])
    except Exception:
        return False


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


# How gloo says a peer's connection ended (closed, reset, or a read that failed on it): the peer's process ended or
# is leaving its group. The live peers fail in the same moment and report within milliseconds.
_PEER_CLOSED = ("connection closed by peer", "connection reset by peer", "read error")


def report_grace(exc: BaseException) -> float:
    """How long to wait for the peers' reports after ``exc``: 2 s for a timeout (a peer may be slow to fail too),
    0.5 s when a peer's connection closed, where the silent one is the one that closed it (a dead process never
    reports, and every SIGKILL would cost the survivors the whole wait)."""
    text = str(exc).lower()
    return 0.5 if any(sign in text for sign in _PEER_CLOSED) else 2.0


def describe_peer_errors(grace: float = 0.0, collective: str | None = None, step: int | None = None) -> str:
    """Lines to append to an error message: what the other ranks reported and, after waiting up to ``grace``
    seconds for their reports, which ranks said nothing. Those never reached the failed collective (stuck before
    it, or dead): usually the ones to look at. ``collective``: what this rank was in; a peer that failed in another
    one means the ranks were out of step. ``step``: this rank's synced step, when steps are posted (GRADSYNC_DEBUG);
    a silent peer that posted another one stopped short or ran ahead. No wait in a group whose members recover
    themselves (:func:`recovered_by_members`)."""
    if grace and not _reports_awaited():
        grace = 0.0  # nor a list of the silent ones: the members' next round names who is gone
    if grace:
        wait_until(lambda: not _still_waiting(peer_errors()), grace, pause=0.02, max_pause=0.05)
    errors = peer_errors()
    if errors is None:
        return "\n  (the other ranks' reports are unreachable: the store lives with rank 0)"
    text = "".join(_report_line(rank, msg) for rank, msg in sorted(errors.items()))
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
            f"\n  rank(s) {silent} reported nothing within {grace:g}s: they never reached this collective "
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


def _still_waiting(errors: dict[int, str] | None) -> bool:
    """Whether a report may still come that says more: the store is there, and not every peer reported."""
    if errors is None:
        return False
    return len(errors) < dist.get_world_size() - 1


def _report_line(rank: int, message: str) -> str:
    return f"\n  rank {rank} reported: {message}"
