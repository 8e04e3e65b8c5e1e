"""Admitting a worker that asked to join, as one member sees it: at a step boundary announced a few steps ahead,
so that no member has to ask the store per step (:meth:`gradsync.elastic.membership.Membership.step_boundary`).
The training thread ticks the committed steps; the heartbeat thread reads the announcement."""

from __future__ import annotations

import math
from dataclasses import dataclass

from gradsync.elastic.liveness import HEARTBEAT_S


@dataclass
class Admission:
    """A member's view of its round's admission: the join requests counted when the round formed, the step whose
    boundary admits (once read), and the training's last committed step and step time (rank 0 announces ahead by
    them). The training thread writes ``step``; the heartbeat thread writes ``at``."""

    requests: int = 0
    at: int | None = None
    step: int = 0
    step_seconds: float | None = None  # a moving average of the time between boundaries; None before two
    beat_s: float = HEARTBEAT_S  # between two of the members' beats (liveness.beat_interval of the round)
    _last: float | None = None

    def tick(self, now: float, step: int) -> None:
        if self._last is not None:
            seconds = now - self._last
            self.step_seconds = seconds if self.step_seconds is None else 0.8 * self.step_seconds + 0.2 * seconds
        self._last, self.step = now, step

    def announced(self, step: int) -> None:
        """The heartbeat thread read rank 0's announcement: the boundary after ``step`` admits."""
        self.at = step

    def steps_ahead(self) -> int | None:
        """How many steps ahead to announce the admitting boundary so that every member's heartbeat thread has
        read it first (None: the step time is not known yet): two beats' worth, and two steps more."""
        if self.step_seconds is None:
            return None
        return 2 + math.ceil(2 * self.beat_s / max(self.step_seconds, 1e-4))
