"""Which members are alive, as one worker sees it: heartbeats on the job's store, and exits reported by launchers.

A heartbeat is a counter each worker sets every ``HEARTBEAT_S`` from a thread with its own store connection (it
never shares a client with the training thread). The worker is the counter's only writer, so a plain set does: on
etcd one put, where an ``add`` is a read and a transaction (two requests). A member whose counter the observer has
*seen* stand still for ``timeout`` seconds of its own clock is dead (no clock is compared across hosts): the time
between its last move and the observer's latest reading, so that a spell in which the observer could not read the
store (an etcd election, its own link down), when the member's beats could not land either, counts against no one. A
worker that exits is reported at once by its launcher (:func:`~.verdicts.mark_exited`: ``exited/<member>``, and -1
in its counter, which is all its watcher reads), so a killed process costs no heartbeat timeout.

In a round each member watches one other, the next in rank order (a ring), so the store serves O(N) heartbeat
reads, not O(N^2): the watcher says when its member is gone (``on_gone``), for everyone. A member is watched by more
only while a round is decided (its leader asks about every candidate).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch.distributed as dist

from gradsync.elastic import keys
from gradsync.store.job_store import StoreHealth

# A member's beat in a round of up to BEATS_PER_S * HEARTBEAT_S members. A host lost whole (its launcher with it, so
# no exit is reported) is found only by its still heartbeat, SUSPECT_BEATS of them, most of such a fault's pause
# (docs/elastic.md, "Under chaos"): a shorter beat finds it sooner, and costs 3 store operations a member at each.
HEARTBEAT_S = 0.1
# The job's beats a second at most, every member's together, so that the store's load stops growing with N past
# 100 members (docs/scaling.md, "The job's store at 256 and 1,024 ranks", measures both stores under it).
BEATS_PER_S = 1000.0
SUSPECT_BEATS = 3  # a member silent this many beats while a round is decided is not waited for (rounds.py)


def beat_interval(members: int, timeout: float) -> float:
    """Seconds between a member's beats in a round of ``members``: ``HEARTBEAT_S`` up to 100 members, then
    longer, so that the job beats ``BEATS_PER_S`` times a second at most, but never over a fifth of ``timeout``
    (a watcher reads its member five times at least before it calls it dead).

    >>> beat_interval(16, 10.0), beat_interval(1024, 10.0), beat_interval(100_000, 10.0)
    (0.1, 1.024, 2.0)
    """
    return max(HEARTBEAT_S, min(members / BEATS_PER_S, timeout / 5))


_EXITED = keys.EXITED_BEAT  # the counter recorded for a member its launcher saw exit


@dataclass(frozen=True)
class _Seen:
    """A watched member's counter as last read: its value, when it last moved, when it was last read."""

    count: int
    moved: float
    observed: float


class Liveness:
    """Beats for ``me`` and watches the members it is asked about, until :meth:`stop`.

    ``on_gone(member, why)`` is called from the heartbeat thread, once per watched member, when it is first seen
    gone (its exit reported, or its heartbeat stale), so that the members can be told at once."""

    def __init__(
        self,
        store: dist.Store,
        me: int,
        timeout: float,
        on_gone: Callable[[int, str], None] | None = None,
        on_beat: Callable[[dist.Store], None] | None = None,
    ) -> None:
        self.me = me
        self.timeout = timeout
        self._on_gone = on_gone
        self._on_beat = on_beat  # more for this thread to ask the store each beat, on its own connection
        # Written by both threads (the training thread asks about members, the heartbeat thread reads them): under
        # the lock, never held across a store operation or a callback.
        self._lock = threading.Lock()
        self._seen: dict[int, _Seen] = {}
        self._watched: list[int] = []
        self._told: set[int] = set()  # members on_gone was called for
        self.health = StoreHealth()  # this thread's store operations, judged: is the store lost?
        self.interval = HEARTBEAT_S  # between beats: beat_interval of the round's members, once one formed
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, args=(store,), name="gradsync-heartbeat")
        self._beat.daemon = True
        self._beat.start()

    def _heartbeat(self, store: dist.Store) -> None:
        """Set this worker's counter and read the watched members' counters, every ``interval``."""
        beats = 0
        while not self._stop.wait(self.interval):
            began = time.monotonic()
            try:
                beats += 1
                store.set(keys.beat(self.me), str(beats))
                with self._lock:
                    watched = list(self._watched)
                for member in watched:
                    self._observe(member, int(store.add(keys.beat(member), 0)))  # 0 if it never beat yet
                    self._tell_if_gone(member)
                if self._on_beat is not None:
                    self._on_beat(store)
                self.health.ok()
            except Exception as exc:  # the store is out of reach (a link down): beat again once it is back
                self.health.failed(exc, since=began)

    def _tell_if_gone(self, member: int) -> None:
        if self._on_gone is None or self.alive(member):
            return
        with self._lock:
            first = member not in self._told
            self._told.add(member)
        if first:
            self._on_gone(member, self.why_dead(member))

    def _observe(self, member: int, count: int) -> None:
        with self._lock:
            self._observe_locked(member, count, time.monotonic())

    def _observe_locked(self, member: int, count: int, now: float) -> None:
        if count == _EXITED:  # its launcher saw it exit: no need to wait
            self._seen[member] = _Seen(_EXITED, float("-inf"), 0.0)
            return
        last = self._seen.get(member)
        if last is None or last.count not in (count, _EXITED):
            self._seen[member] = _Seen(count, now, now)
        elif last.count != _EXITED:
            self._seen[member] = _Seen(count, last.moved, now)

    def watch_only(self, members: list[int]) -> None:
        """A round formed with ``members`` (in rank order): watch the one after this worker, with a fresh timeout,
        beating at the round's ``beat_interval``."""
        self.interval = beat_interval(len(members), self.timeout)
        ring = members if self.me in members else [*members, self.me]
        successor = ring[(ring.index(self.me) + 1) % len(ring)]
        with self._lock:
            self._watched = [successor] if successor != self.me else []
            for member in self._watched:
                self._seen.pop(member, None)
            self._told.clear()

    def alive(self, member: int) -> bool:
        """Whether ``member``'s heartbeat moved within ``timeout``; a member not yet watched is watched from now."""
        if member == self.me:
            return True
        with self._lock:
            if member not in self._watched:
                self._watched.append(member)
                # Watched again (a joiner asks to be admitted after it was dropped): its timeout starts now. The count
                # last seen, from before it was dropped, would declare it dead until a heartbeat poll happened to land
                # here, and every round meanwhile would form without it. An exit its launcher reported stays final.
                last = self._seen.get(member)
                if last is None or last.count != _EXITED:
                    self._seen.pop(member, None)
                    self._told.discard(member)
        return self.still_for(member) <= self.timeout

    def _last(self, member: int) -> _Seen | None:
        with self._lock:
            return self._seen.get(member)

    def last_count(self, member: int) -> int:
        """``member``'s counter as this worker last read it (0: never read)."""
        last = self._last(member)
        return last.count if last is not None else 0

    def suspects(self, members: Collection[int]) -> dict[int, float]:
        """The watched ``members`` whose counter this worker has seen stand still for ``SUSPECT_BEATS`` beats, with
        for how long: a live member's heartbeat thread beats even inside a collective, so these are most likely
        dead, though not yet past the timeout."""
        limit = SUSPECT_BEATS * self.interval
        with self._lock:
            watched = list(self._watched)
        still = {m: self.still_for(m) for m in watched if m in members}
        return {m: s for m, s in still.items() if s >= limit}

    def still_for(self, member: int) -> float:
        """For how long this worker has seen ``member``'s counter stand still (inf: its exit was reported; 0: not
        read yet, or itself)."""
        last = self._last(member)
        if member == self.me or last is None:
            return 0.0
        return float("inf") if last.count == _EXITED else last.observed - last.moved

    def _exited(self, member: int) -> bool:
        last = self._last(member)
        return last is not None and last.count == _EXITED

    def why_dead(self, member: int) -> str:
        exited = self._exited(member)
        return "exited (its launcher saw it)" if exited else f"stopped (no heartbeat for {self.timeout:g}s)"

    def stop(self) -> None:
        self._stop.set()
