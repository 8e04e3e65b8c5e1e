"""A worker's side of ``gradsync run --watchdog``: mark this rank's progress where the launcher watches
(:mod:`gradsync.launch.watchdog`), and print this process's stacks when the launcher asks (SIGUSR1).

The library calls it from below (each synced forward of a DistributedDataParallel); the launcher's side lives
above, with the launchers, and the two share only the folder variable.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

FOLDER_VARIABLE = "GRADSYNC_WATCHDOG_DIR"


def progress_reporter(environ: dict[str, str] | None = None) -> Callable[[], None] | None:
    """In a worker started with ``--watchdog``: a function marking this rank's progress; None otherwise."""
    env = os.environ if environ is None else environ
    folder = env.get(FOLDER_VARIABLE)
    if not folder:
        return None
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True, chain=False)
    marker = Path(folder) / f"rank{env.get('RANK', '0')}"
    marker.write_text(str(os.getpid()))  # after register(): this pid may now be sent SIGUSR1
    last = [time.monotonic()]

    def report() -> None:
        now = time.monotonic()
        if now - last[0] >= 1.0:
            last[0] = now
            marker.touch()

    return report
