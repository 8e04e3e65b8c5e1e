"""The elastic job's three waits, each a setting of its own with an environment override: a member's heartbeat,
a collective of the round's group, and a joiner's admission."""

from __future__ import annotations

from dataclasses import dataclass

from gradsync import settings
from gradsync.validate import require_seconds


@dataclass(frozen=True)
class Timeouts:
    """elastic's three waits, each with its own meaning (seconds):

    - ``heartbeat``: a member whose heartbeat has not moved for this long counts as lost;
    - ``collective``: the round's process group's timeout: a collective with a stopped member fails after it;
    - ``admission``: how long a worker asking to join waits to be admitted.

    Each has a ``GRADSYNC_ELASTIC_*_TIMEOUT`` override (HEARTBEAT, COLLECTIVE, ADMISSION).

    Example::

        timeouts = Timeouts(heartbeat=10, collective=30, admission=600)   # gradsync.elastic.init(10, 30, 600)'s
    """

    heartbeat: float = 10.0
    collective: float = 10.0
    admission: float = 600.0

    def __post_init__(self) -> None:
        # Checked when built, not when the first heartbeat is late: NaN would never count a member lost, 0 at once.
        for name in ("heartbeat", "collective", "admission"):
            object.__setattr__(self, name, require_seconds("elastic.Timeouts", name, getattr(self, name)))

    @classmethod
    def read(cls, heartbeat: float, collective: float | None, admission: float) -> Timeouts:
        heartbeat = settings.read_seconds("GRADSYNC_ELASTIC_HEARTBEAT_TIMEOUT", heartbeat)
        collective = settings.read_seconds("GRADSYNC_ELASTIC_COLLECTIVE_TIMEOUT", collective or heartbeat)
        admission = settings.read_seconds("GRADSYNC_ELASTIC_ADMISSION_TIMEOUT", admission)
        return cls(heartbeat, collective, admission)
