"""Names a NCCL collective that failed or is stuck, before NCCL's watchdog ends the process.

On gloo a failed or timed-out collective raises in the thread that waits for it, and the
:class:`~gradsync.collectives.communicator.Communicator` names it: the operation, the bucket, what the other ranks
reported, who never arrived, what to do. NCCL's collectives are asynchronous: the host only enqueues them, ``wait()``
orders streams, and NCCL's watchdog (``TORCH_NCCL_ASYNC_ERROR_HANDLING``, on by default) tears the process down at
the group's timeout, or at an error, with a message that names a sequence number and an op type, not gradsync's
bucket nor the ranks that never came. ``TORCH_NCCL_BLOCKING_WAIT`` would raise in ``wait()`` instead, but it makes
the host wait for every bucket, and the overlap goes.

So on a NCCL group the Communicator hands each collective it issues to a :class:`Watch`: a daemon thread queries
each one's completion (``Work.is_completed()``, a CUDA event query: no sync) every ``poll_seconds`` and, when one
failed or is still running at ``WARN_FRACTION`` of the group's timeout, says so in gradsync's words on stderr and
posts it to the store for the other ranks' errors, while the process is still alive to say it.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

WARN_FRACTION = 0.9  # of the group's timeout: late enough to be no false alarm, early enough to beat the watchdog


@dataclass
class _Watched:
    work: Any  # a torch.distributed.Work
    what: Callable[[], str]  # the collective, named (built only when it is reported)
    started: float
    reported: bool = field(default=False)


class Watch:
    """Collectives in flight on one NCCL group, checked from a daemon thread.

    ``report(what, reason)`` is called once per collective that failed or ran past ``WARN_FRACTION`` of
    ``timeout_seconds``; the Communicator's report names it, prints it and posts it for the peers.

    Example::

        watch = Watch(timeout_seconds=600, report=lambda what, reason: print(what, reason))
        watch.add(work, lambda: "all-reduce of bucket 3")    # each collective issued on the NCCL group
        watch.check()                                        # what the thread does every second
    """

    def __init__(
        self,
        timeout_seconds: float,
        report: Callable[[str, str], None],
        poll_seconds: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.timeout_seconds = timeout_seconds
        self._report = report
        self._poll_seconds = poll_seconds
        self._clock = clock
        self._watched: list[_Watched] = []
        self._lock = threading.Lock()  # add() runs on the training (or autograd) thread, check() on the watch's
        self._thread: threading.Thread | None = None

    def add(self, work: Any, what: Callable[[], str]) -> None:
        """Watch ``work`` until it completes; ``what()`` names it if it does not."""
        with self._lock:
            self._watched.append(_Watched(work, what, self._clock()))
        if self._thread is None:
            self._thread = _start_polling(self, self._poll_seconds)

    def check(self) -> None:
        """Forget completed collectives; report each failed one, and each running past the warning point."""
        now = self._clock()
        with self._lock:
            watched, self._watched = self._watched, []
        keep = []
        for entry in watched:
            reason = self._problem(entry, now)
            if reason is not None and not entry.reported:
                entry.reported = True
                self._report(entry.what(), reason)
            if not entry.work.is_completed():
                keep.append(entry)
        with self._lock:
            self._watched = keep + self._watched

    def _problem(self, entry: _Watched, now: float) -> str | None:
        if entry.work.is_completed():
            error = entry.work.exception() if not entry.work.is_success() else None
            return None if error is None else f"NCCL reported: {error}"
        elapsed = now - entry.started
        if elapsed < WARN_FRACTION * self.timeout_seconds:
            return None
        return (
            f"still running after {elapsed:.0f}s of the process group's {self.timeout_seconds:.0f}s timeout; NCCL's "
            "watchdog will end this process at the timeout"
        )

    def in_flight(self) -> int:
        with self._lock:
            return len(self._watched)


def _start_polling(watch: Watch, seconds: float) -> threading.Thread:
    """A daemon thread that checks ``watch`` every ``seconds`` while it exists (held weakly: a Communicator that is
    gone stops its thread)."""
    ref = weakref.ref(watch)

    def poll() -> None:
        while True:
            time.sleep(seconds)
            current = ref()
            if current is None:
                return
            current.check()
            del current

    thread = threading.Thread(target=poll, name="gradsync-nccl-watch", daemon=True)
    thread.start()
    return thread
