"""A worker stopped by a signal, seen by its launcher: killed after a grace, so that its peers need not wait.

A worker stopped with SIGSTOP (or SIGTSTP: state ``T`` in ``/proc/<pid>/stat``) holds the others in the collective
they share with it until the round's group times out, and its heartbeat thread is stopped with it, so the members
would learn of it only after the heartbeat timeout, which would then be the whole pause. Its launcher sees the stop
at once: once the worker has been stopped for ``GRADSYNC_ELASTIC_STOPPED_SECONDS`` (0.2 s by default) the launcher
kills it, which closes its connections (the peers' collective fails within milliseconds), reports the exit and
restarts it, as for any failed worker; it rejoins at a step boundary. A worker being traced (a debugger, py-spy:
state ``t``) is left alone, and a host frozen whole (its launcher with it) is found by the heartbeats
(:mod:`gradsync.elastic.liveness`).
"""

from __future__ import annotations

from pathlib import Path

from gradsync import settings

STOPPED_VARIABLE = "GRADSYNC_ELASTIC_STOPPED_SECONDS"
STOPPED_S = 0.2


def is_stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped by a signal (state ``T``); False where /proc cannot tell (not Linux, gone).

    >>> import os
    >>> is_stopped(os.getpid())
    False
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    fields = stat.rsplit(")", 1)[-1].split()  # the command name, in parentheses, may hold spaces
    return bool(fields) and fields[0] == "T"


class StopWatch:
    """How long each worker process has been seen stopped; ``overdue`` once that reaches the grace."""

    def __init__(self, grace_s: float | None = None) -> None:
        self.grace_s = settings.read_seconds(STOPPED_VARIABLE, STOPPED_S) if grace_s is None else grace_s
        self._since: dict[int, float] = {}

    def overdue(self, pid: int, now: float) -> bool:
        if not is_stopped(pid):
            self._since.pop(pid, None)
            return False
        return now - self._since.setdefault(pid, now) >= self.grace_s
