"""gradsync's log lines carry the time when the program set up no logging (gradsync/log.py), and only the program's
format once it did: an elastic job's workers and launchers write to their stderr files, which an on-call engineer
lines up against each other and against the faults."""

from __future__ import annotations

import re
import subprocess
import sys

STAMPED = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z gradsync elastic: worker 3 is gone$")


def _stderr(code: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    return done.stderr.splitlines()


def test_a_warning_carries_the_time_when_the_program_configured_no_logging() -> None:
    lines = _stderr(
        "from gradsync.log import log\n"
        "log.info('not shown: below warning, as with the last resort')\n"
        "log.warning('gradsync elastic: worker %d is gone', 3)\n"
    )
    assert len(lines) == 1 and STAMPED.match(lines[0]), lines


def test_a_program_that_configures_logging_gets_its_format_once() -> None:
    lines = _stderr(
        "import logging\n"
        "from gradsync.log import log\n"
        "logging.basicConfig(format='mine: %(name)s %(message)s')\n"
        "log.warning('gradsync elastic: worker %d is gone', 3)\n"
    )
    assert lines == ["mine: gradsync gradsync elastic: worker 3 is gone"], lines
