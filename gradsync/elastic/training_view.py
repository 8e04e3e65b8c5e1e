"""What a worker's training thread is in, as its heartbeat thread may read it: one object, one lock.

The heartbeat thread acts on what the training thread waits on: it abandons a round whose leader is gone, calls off
a round whose group is forming with a member gone, marks a member of the current round lost, and reads the
admitting step rank 0 announces (:meth:`gradsync.elastic.membership.Membership._each_beat`). Those were fields of
three classes, written by one thread and read by the other. Here the training thread records each change under a
lock, and the heartbeat thread reads one :class:`Seen` snapshot per decision: a reader checks the thread boundary
in this file alone (issue 59; torchft's Manager keeps its state under one lock the same way).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from gradsync.elastic.liveness import HEARTBEAT_S


@dataclass(frozen=True)
class Round:
    """A membership round as one worker is in it: its number, its members in rank order, and the worker."""

    number: int
    members: list[int]  # sequence numbers, in rank order
    me: int

    @property
    def rank(self) -> int:
        return self.members.index(self.me)

    @property
    def world_size(self) -> int:
        return len(self.members)


@dataclass
class Admission:
    """A member's view of its round's admission of the workers asking to join: the join requests counted when the
    round formed, the step whose boundary admits (once read), and the training's last committed step and step time
    (rank 0 announces ahead by them), so that no member asks the store per step
    (:meth:`gradsync.elastic.membership.Membership.step_boundary`). :class:`TrainingView` replaces it whole on each
    change, under its lock: the training thread's ticks set ``step``, the heartbeat thread's reading of the
    announcement ``at``."""

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

    def steps_ahead(self) -> int | None:
        """How many steps ahead to announce the admitting boundary so that every member's heartbeat thread has
        read it first (None: the step time is not known yet): two beats' worth, and two steps more."""
        if self.step_seconds is None:
            return None
        return 2 + math.ceil(2 * self.beat_s / max(self.step_seconds, 1e-4))


@dataclass(frozen=True)
class Seen:
    """One consistent read of the training thread's state.

    ``round``: the round it is in; ``formed``: that round, once its group formed; ``forming``: the round whose
    group it is forming; ``leader``: (round number, worker) whose member list it waits for; ``admission``: a copy of
    its round's admission (the join requests counted, the steps it committed, the step announced)."""

    round: Round | None = None
    formed: Round | None = None
    forming: Round | None = None
    leader: tuple[int, int] | None = None
    admission: Admission | None = None


class TrainingView:
    """The training thread writes through the methods below; the heartbeat thread calls :meth:`seen` and the two
    methods that report back (:meth:`lost_while_forming`, :meth:`announce`). No other field crosses the threads.

    Example::

        view = TrainingView()
        with view.forming(round_):
            ...                         # the heartbeat thread's view.seen().forming is round_ meanwhile
        view.formed(round_)
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen = Seen()
        self._lost_while_forming: int | None = None  # the round number the heartbeat thread saw a member lost in

    def seen(self) -> Seen:
        with self._lock:
            return self._seen

    def _change(self, **fields: object) -> None:
        with self._lock:
            self._seen = dataclasses.replace(self._seen, **fields)  # type: ignore[arg-type]

    # ------------------------------------------------------------------------------------ the training thread
    def entered(self, round_: Round, requests: int, beat_s: float) -> None:
        """The training thread entered ``round_`` with ``requests`` join requests counted."""
        self._change(round=round_, admission=Admission(requests, beat_s=beat_s))

    def left_out(self) -> None:
        """The training thread was left out of the round it was in, and joins again."""
        self._change(round=None)

    @contextlib.contextmanager
    def waiting_for(self, number: int, leader: int) -> Iterator[None]:
        """The training thread waits for round ``number``'s member list from ``leader``."""
        self._change(leader=(number, leader))
        try:
            yield
        finally:
            self._change(leader=None)

    @contextlib.contextmanager
    def forming(self, round_: Round) -> Iterator[None]:
        """The training thread forms ``round_``'s group."""
        self._change(forming=round_)
        try:
            yield
        finally:
            self._change(forming=None)

    def formed(self, round_: Round) -> None:
        self._change(formed=round_)

    def committed(self, step: int) -> int | None:
        """The training thread committed ``step``: the step whose boundary admits the joiners, once announced."""
        with self._lock:
            admission = self._seen.admission
            assert admission is not None, "committed() before the training thread entered a round"
            admission = dataclasses.replace(admission)
            admission.tick(time.monotonic(), step)
            self._seen = dataclasses.replace(self._seen, admission=admission)
            return admission.at

    def was_lost_while_forming(self, number: int) -> bool:
        """Whether the heartbeat thread saw a member of round ``number`` lost as its group formed."""
        with self._lock:
            return self._lost_while_forming == number

    # ----------------------------------------------------------------------------------- the heartbeat thread
    def lost_while_forming(self, number: int) -> None:
        """A member of round ``number``, whose group is forming, is gone: the failure to form is explained."""
        with self._lock:
            self._lost_while_forming = number

    def announce(self, number: int, step: int) -> None:
        """Rank 0 announced that round ``number`` admits its joiners at ``step``'s boundary (ignored when the
        training thread has moved to another round since)."""
        with self._lock:
            seen = self._seen
            if seen.round is None or seen.round.number != number or seen.admission is None:
                return
            admission = dataclasses.replace(seen.admission, at=step)
            self._seen = dataclasses.replace(seen, admission=admission)
