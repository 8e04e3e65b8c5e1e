"""gradsync's logger, ``"gradsync"``, whose lines carry the time (UTC, to the millisecond) when the program set up
no logging of its own.

A library leaves logging's set-up to its program, and Python then writes a warning through its last-resort handler:
the message alone. For an elastic job that leaves the on-call engineer with the workers' and launchers' lines and no
way to line them up against each other or against the faults (a survivor's "trying the next round" looks the same as
its next one). So gradsync's lines take the last resort's place with a timestamp, ISO 8601 in UTC so that hosts in
other time zones sort together, and step aside the moment the program configures a handler of its own
(``logging.basicConfig``, pytest's capture), which then formats them as it likes.

Example::

    from gradsync.log import log
    log.warning("gradsync elastic: %s", "worker 3 is gone")
    # 2026-12-06T05:20:46.123Z gradsync elastic: worker 3 is gone
"""

from __future__ import annotations

import logging
import sys
import time

log = logging.getLogger("gradsync")


class StampedLastResort(logging.Handler):
    """Python's last-resort handler (warnings and worse, to the current ``sys.stderr``), with a timestamp; silent
    while any other handler would take the record."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        formatter = logging.Formatter("%(asctime)s.%(msecs)03dZ %(message)s", "%Y-%m-%dT%H:%M:%S")
        formatter.converter = time.gmtime
        self.setFormatter(formatter)

    def emit(self, record: logging.LogRecord) -> None:
        if _handled_elsewhere(logging.getLogger(record.name), self):
            return
        try:
            sys.stderr.write(self.format(record) + "\n")
            sys.stderr.flush()
        except Exception:
            self.handleError(record)


def _handled_elsewhere(logger: logging.Logger | None, this: logging.Handler) -> bool:
    """Whether a handler other than ``this`` sits on ``logger`` or an ancestor it propagates to: the same walk
    as ``Logger.callHandlers``, which uses the last resort only when it finds none."""
    while logger is not None:
        if any(h is not this for h in logger.handlers):
            return True
        logger = logger.parent if logger.propagate else None
    return False


if not any(isinstance(h, StampedLastResort) for h in log.handlers):  # once, however often this is imported
    log.addHandler(StampedLastResort())
