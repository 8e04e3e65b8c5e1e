"""Where a recovery's seconds went: the time spent in each of its phases, for its log line and its
:class:`~gradsync.elastic.state.Recovery` record.

A recovery's total says that a pause was long, not why: in a line such as "6 -> 2 workers at step 2737 in 5.47s",
the seconds could be the old group's close, the next round's agreement, the new group's connection, or the model's
first collectives waiting on a member lost meanwhile. Each phase answers to a different bound (docs/elastic.md), so
the line names them, and a failed recovery names the phase it failed in.

Example::

    clock = Phases()
    with clock.phase("leave"):
        pass
    clock.seconds()        # {'leave': 0.0}
    clock.describe()       # 'leave 0.00s'
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator


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
