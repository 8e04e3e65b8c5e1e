"""gradsync/launch/stopped.py: a launcher tells a worker stopped by a signal from a running one, and calls it
overdue only after the grace (the lab's sigstop runs, tests/test_elastic.py, show the rest: killed, restarted)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from gradsync.launch.stopped import StopWatch, is_stopped

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def _until(predicate, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_a_stopped_worker_is_overdue_after_the_grace_and_not_before() -> None:
    process = subprocess.Popen(["sleep", "30"])
    try:
        watch = StopWatch(grace_s=0.5)
        assert not is_stopped(process.pid) and not watch.overdue(process.pid, now=0.0)
        os.kill(process.pid, signal.SIGSTOP)
        assert _until(lambda: is_stopped(process.pid))
        assert not watch.overdue(process.pid, now=10.0)  # first seen stopped now
        assert not watch.overdue(process.pid, now=10.4)
        assert watch.overdue(process.pid, now=10.5)
        os.kill(process.pid, signal.SIGCONT)  # continued before it was killed: its time starts afresh
        assert _until(lambda: not is_stopped(process.pid))
        assert not watch.overdue(process.pid, now=11.0)
        os.kill(process.pid, signal.SIGSTOP)
        assert _until(lambda: is_stopped(process.pid))
        assert not watch.overdue(process.pid, now=11.2)
    finally:
        process.kill()
        process.wait()
    assert not is_stopped(process.pid)  # gone: /proc cannot tell, so not stopped
