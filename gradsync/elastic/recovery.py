"""A recovery, as a worker records it: what it cost (:class:`Recovery`), where its seconds went (:class:`Phases`),
and when to stop recovering (:class:`FutileRecoveries`).

**Phases.** A recovery's total says that a pause was long, not why: in a line such as "6 -> 2 workers at step 2737
in 5.47s", the seconds could be the old group's close, the next round's agreement, the new group's connection, or
the model's first collectives waiting on a member lost meanwhile. Each phase answers to a different bound
(docs/elastic.md), so the line names them, and a failed recovery names the phase it failed in.

**When to give up.** Recovery is retried while members are lost during it (a round's leader killed, a member lost as
the group forms), and a recovery that can never succeed (replicas that differ, a hook that fails every time) must
end. A count of changes alone is not the rule: a burst of faults (several rounds' leaders killed one after the
other) makes more than ``MAX_FUTILE`` changes within seconds, and the last member holding the job's state must not
give up then, or the state goes with it. So a worker gives up only after more than ``MAX_FUTILE`` changes *and*
``FUTILE_TIMEOUTS`` heartbeat timeouts without a committed step: a burst of faults lasts seconds, and a recovery
that cannot succeed still ends within half a minute at a 5 s timeout.

Example::

    clock = Phases()
    with clock.phase("leave"):
        pass
    clock.describe()                     # 'leave 0.00s'
    futile = FutileRecoveries(heartbeat_timeout=5.0)
    futile.count(steps=120, now=0.0)     # None while it may go on; else why it gives up
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

MAX_FUTILE = 5  # membership changes in a row without a committed step, at least, before giving up
FUTILE_TIMEOUTS = 6  # and heartbeat timeouts without one


@dataclass(frozen=True)
class Recovery:
    """One membership change: when, why, and what it cost (recorded in ``State.recoveries``).

    Example::

        for change in state.recoveries:   # one Recovery per membership change this worker survived
            print(f"step {change.step}: {change.world_before} -> {change.world_after} ranks in {change.seconds:.2f} s")
    """

    step: int
    reason: str
    world_before: int
    world_after: int
    seconds: float
    phases: dict[str, float] = field(default_factory=dict)  # seconds in each phase (:class:`Phases`)


class Phases:
    """Seconds per named phase, in order; the phase an exception left, if one did."""

    def __init__(self) -> None:
        self._seconds: dict[str, float] = {}
        self.failed_in: str | None = None

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        began = time.monotonic()
        try:
            yield
        except BaseException:
            self.failed_in = name
            raise
        finally:
            self._seconds[name] = time.monotonic() - began

    def seconds(self) -> dict[str, float]:
        return dict(self._seconds)

    def describe(self) -> str:
        """``"leave 0.01s, round 0.12s, ..."``, the failing phase last when there is one."""
        return ", ".join(f"{name} {s:.2f}s" for name, s in self._seconds.items())


class FutileRecoveries:
    """Membership changes since this worker's last committed step (see the module)."""

    def __init__(self, heartbeat_timeout: float) -> None:
        self._give_up_s = FUTILE_TIMEOUTS * heartbeat_timeout
        self._count, self._at_step, self._since = 0, -1, 0.0

    def count(self, steps: int, now: float) -> str | None:
        """A change at ``steps`` committed steps, at ``now`` (monotonic seconds): why to give up, or None."""
        if steps != self._at_step:  # a step committed since the last change: a fresh row
            self._count, self._at_step, self._since = 0, steps, now
        self._count += 1
        if self._count > MAX_FUTILE and now - self._since >= self._give_up_s:
            return f"{self._count} membership changes in {now - self._since:.0f}s without a committed step"
        return None
