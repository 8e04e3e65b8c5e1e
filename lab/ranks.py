"""Waiting for a benchmark's rank processes: all of them within one deadline, none left running."""

from __future__ import annotations

import subprocess
import time


def wait_ranks(procs: list[subprocess.Popen], timeout: float, who: str) -> None:
    """Wait up to ``timeout`` seconds for every process; kill what still runs; exit naming the ranks that failed."""
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    codes = [p.wait() for p in procs]  # reaped: a killed one's code is known only now
    failed = [(rank, code) for rank, code in enumerate(codes) if code != 0]
    if failed:
        raise SystemExit(f"{who}: rank(s) failed (rank, exit code): {failed}")
