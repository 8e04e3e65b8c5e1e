"""An opt-in progress watchdog: ``gradsync run --watchdog SECONDS`` (the launcher's side; the workers' is
:mod:`gradsync.runtime.progress`).

A worker that hangs without a collective (a deadlock in data loading, an infinite loop, a stuck filesystem) keeps
torchrun and every other rank waiting forever. With the watchdog, each worker marks its progress in a file per
rank at every synced forward (at most once a second: a step finished); the launcher watches those files, and when
no rank has made progress for SECONDS it asks every worker for its Python stacks (``faulthandler`` on SIGUSR1,
into the stderr the launcher already keeps), prints them, and stops the job.

The clock starts at the first mark (a rank built its DistributedDataParallel): start-up (imports, reading a
dataset, building the model) is not a step and may take far longer than a step, and a worker that has not yet
registered its stack handler would be killed by SIGUSR1 instead of printing its stack. For the same reason each
marker holds its worker's pid, and only those workers are sent SIGUSR1; the others are only stopped.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

from gradsync.runtime.progress import FOLDER_VARIABLE  # noqa: F401 (the launcher sets it; the workers read it)


# ----------------------------------------------------------------------------------------- launcher side
class Watchdog(threading.Thread):
    """Watches ``folder``; after ``seconds`` without progress calls ``on_stall(seconds_since_progress)`` once."""

    def __init__(self, folder: Path, seconds: float, on_stall: Callable[[float], None]) -> None:
        super().__init__(name="gradsync-watchdog", daemon=True)
        self.folder = folder
        self.seconds = seconds
        self.on_stall = on_stall
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(min(1.0, self.seconds / 4)):
            last = self.last_progress()
            idle = 0.0 if last is None else time.time() - last
            if idle > self.seconds:
                self.on_stall(idle)
                return

    def last_progress(self) -> float | None:
        """When a rank last marked progress; None before any rank has (start-up is not watched)."""
        return max((marker.stat().st_mtime for marker in self.folder.glob("rank*")), default=None)

    def stop(self) -> None:
        self._stop_event.set()


def child_pids(parent: int | None = None) -> list[int]:
    """The processes whose parent is ``parent`` (default: this one): the workers torch elastic started."""
    parent = os.getpid() if parent is None else parent
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == parent:
            found.append(int(entry.name))
    return found


def registered_pids(folder: Path) -> set[int]:
    """The workers that registered the stack handler: the pids their progress markers hold."""
    pids = set()
    for marker in folder.glob("rank*"):
        try:
            pids.add(int(marker.read_text()))
        except (OSError, ValueError):
            continue  # being written, or not yet
    return pids


def dump_stacks_and_stop(pids: list[int], registered: set[int], grace: float = 2.0) -> None:
    """Ask each registered worker for its Python stacks (faulthandler, into its stderr), then stop them all.

    SIGUSR1's default action kills a process, so a worker that never registered the handler is only stopped."""
    for pid in pids:
        if pid in registered:
            _signal(pid, signal.SIGUSR1)
    time.sleep(grace)  # the stacks reach the stderr files the launcher tees
    for pid in pids:
        _signal(pid, signal.SIGTERM)


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
