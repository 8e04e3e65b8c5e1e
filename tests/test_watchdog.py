"""The launcher's progress watchdog, in one process: when its clock starts, and whom it asks for stacks."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from gradsync.launch import watchdog
from gradsync.runtime import progress


def _watch(folder: Path, seconds: float) -> tuple[watchdog.Watchdog, threading.Event]:
    stalled = threading.Event()
    dog = watchdog.Watchdog(folder, seconds, lambda idle: stalled.set())
    dog.start()
    return dog, stalled


@pytest.mark.timeout(30)
def test_start_up_is_not_watched_and_the_clock_starts_at_the_first_mark(tmp_path: Path) -> None:
    dog, stalled = _watch(tmp_path, 0.4)
    try:
        assert not stalled.wait(1.5)  # three allowances of start-up (imports, a dataset): no stall
        report = progress.progress_reporter({progress.FOLDER_VARIABLE: str(tmp_path), "RANK": "3"})
        assert report is not None
        assert (tmp_path / "rank3").read_text().isdigit()
        assert stalled.wait(5)
    finally:
        dog.stop()
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)


def test_no_reporter_without_the_launcher_variable() -> None:
    assert progress.progress_reporter({}) is None


@pytest.mark.timeout(30)
def test_only_workers_that_registered_are_asked_for_stacks(tmp_path: Path) -> None:
    # A worker that has not registered faulthandler's SIGUSR1 handler would die of SIGUSR1, printing nothing.
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    (tmp_path / "rank0").write_text("999999999")  # a registered worker, already gone
    assert watchdog.registered_pids(tmp_path) == {999999999}
    watchdog.dump_stacks_and_stop([worker.pid, 999999999], watchdog.registered_pids(tmp_path), grace=0.1)
    assert worker.wait(10) == -signal.SIGTERM
