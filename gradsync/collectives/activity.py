"""When this process last issued or finished a collective, and whether it waits on one now: what an elastic worker's
heartbeat thread tells the others of its training thread.

A member whose heartbeat beats but whose training thread hangs outside any collective (user code, a data loader or
a file system stuck inside a step) looks alive; the others fail their collective at its timeout, and the round's
leader would then wait another timeout for it to register, as for a member still inside a collective that has yet
to fail. Outside every collective for longer than that timeout, no peer could have been waiting on it without
failing already: it is stalled, and the leader need not wait (gradsync/elastic/rounds.py). The share of its time a
member spends outside collectives also tells which member the others wait on: a straggler (gradsync/elastic/pace.py).

Torch's process groups call nothing when a collective starts, so gradsync's :class:`~.communicator.Communicator`
marks its own. The record is the process's (:func:`of_this_process`), not a communicator's: the model's, the
optimizer's and the elastic state's communicators all speak for the same training thread, and the model is built
before the elastic job's state knows of it. Outside an elastic job there is none, and nothing is marked.

Example::

    activity = CollectiveActivity()
    with activity.inside():          # a collective issued or waited on
        pass
    activity.outside_for()           # seconds since, or None while inside one
    activity.outside_total()         # seconds outside every collective, in all
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

from gradsync import settings


class CollectiveActivity:
    """Written by the threads that issue and wait on collectives, read by the heartbeat thread: under a lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._inside = 0  # collectives being issued or waited on now
        self._since = time.monotonic()  # when the last one began or ended
        self._outside_s = 0.0  # seconds spent outside every collective before ``_since``

    @contextlib.contextmanager
    def inside(self) -> Iterator[None]:
        self.enter()
        try:
            yield
        finally:
            self.leave()

    def enter(self) -> None:
        with self._lock:
            now = time.monotonic()
            if not self._inside:
                self._outside_s += now - self._since
            self._inside += 1
            self._since = now

    def leave(self) -> None:
        with self._lock:
            self._inside -= 1
            self._since = time.monotonic()

    def outside_for(self) -> float | None:
        """Seconds since the last collective began or ended; None while one is issued or waited on."""
        with self._lock:
            return None if self._inside else time.monotonic() - self._since

    def outside_total(self) -> float:
        """Seconds spent outside every collective since this record was made: computing, loading data, or stuck."""
        with self._lock:
            return self._outside_s + (0.0 if self._inside else time.monotonic() - self._since)


_this_process: list[CollectiveActivity] = []  # made at the first use in an elastic worker


def of_this_process() -> CollectiveActivity | None:
    """The record of this process's collectives in a worker of ``gradsync run --elastic``; None elsewhere.

    >>> of_this_process() is None   # not an elastic worker
    True
    """
    if not settings.in_elastic_job():
        return None
    if not _this_process:
        _this_process.append(CollectiveActivity())
    return _this_process[0]
