"""When a worker stops recovering: membership changes in a row without a committed step, counted and timed.

Recovery is retried while members are lost during it (a round's leader killed, a member lost as the group forms),
and a recovery that can never succeed (replicas that differ, a hook that fails every time) must end. A count of
changes alone is not the rule: a burst of faults (several rounds' leaders killed one after the other) makes more than
``MAX_FUTILE`` changes within seconds, and the last member holding the job's state must not give up then, or the
state goes with it. So a worker gives up only after more than ``MAX_FUTILE`` changes *and* ``FUTILE_TIMEOUTS``
heartbeat timeouts without a committed step: a burst of faults lasts seconds, and a recovery that cannot succeed
still ends within half a minute at a 5 s timeout.

Example::

    futile = FutileRecoveries(heartbeat_timeout=5.0)
    futile.count(steps=120, now=0.0)     # None while it may go on; else why it gives up
"""

from __future__ import annotations

MAX_FUTILE = 5  # membership changes in a row without a committed step, at least, before giving up
FUTILE_TIMEOUTS = 6  # and heartbeat timeouts without one


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
