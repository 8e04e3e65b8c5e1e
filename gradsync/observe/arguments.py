"""The checks of what the observe functions are given: step records, per rank (what ``Monitor.gather()`` and
:func:`gradsync.observe.read_steps` return), each refused by name when given, not as an AttributeError from the
middle of a breakdown."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from gradsync.errors import ConfigError
from gradsync.observe.recorder import StepRecord

_FIX = "pass Monitor.gather() (on every rank) or read_steps(path)"


def require_steps(where: str, name: str, steps: object) -> Sequence[StepRecord]:
    """``steps`` if it is a sequence of :class:`StepRecord` (``Monitor.steps``, one rank's of ``gather()``)."""
    if not isinstance(steps, Sequence) or isinstance(steps, (str, bytes)):
        raise ConfigError(f"{where}: {name} must be a list of StepRecord, got {type(steps).__name__} {steps!r:.60}")
    wrong = next((s for s in steps if not isinstance(s, StepRecord)), None)
    if wrong is not None:
        raise ConfigError(
            f"{where}: {name} must hold StepRecords, got {type(wrong).__name__} {wrong!r:.60} among them: {_FIX}."
        )
    return steps


def require_per_rank(where: str, per_rank: object) -> Mapping[int, Sequence[StepRecord]]:
    """``per_rank`` if it maps each rank (an int) to its step records."""
    if not isinstance(per_rank, Mapping):
        raise ConfigError(
            f"{where}: per_rank must be a dict {{rank: [StepRecord, ...]}}, got {type(per_rank).__name__} "
            f"{per_rank!r:.60}: {_FIX}."
        )
    for rank, steps in per_rank.items():
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise ConfigError(f"{where}: per_rank's keys must be ranks (ints), got {rank!r:.40}: {_FIX}.")
        require_steps(where, f"per_rank[{rank}] (of {per_rank!r:.60})", steps)
    return per_rank
