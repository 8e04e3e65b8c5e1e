"""What a deciding round leader knows of the members it wants beyond its own heartbeat reads: the verdicts others
posted in the store. A member is *gone* when its launcher reported its exit (``exited/<member>``) or its watcher
declared it lost at the heartbeat timeout (``lost/<member>``); it is *suspected* when its watcher saw its heartbeat
stand still for ``SUSPECT_BEATS`` beats (``suspected/<member>``, :class:`Suspicions`).

A suspicion posted by the watcher is what lets a host lost whole (no launcher left to report the exit) cost the
watcher's three still beats, counted since the member's last beat, not three more beats counted from the moment the
leader first looks: the leader had not watched that member before the round began, so its own count started only
then (the host kind's pause in the 8-host soak, 0.40-0.54 s median, was mostly that wait: docs/elastic.md). A mark
carries the heartbeat count its writer last saw, so it expires once the member beats again
(:func:`~.liveness.beat_since`): a live member wrongly suspected is awaited again at its next beat.

Every verdict bumps the ``verdicts`` counter; the leader reads it each look (one request) and the marks only when it
moved.

Example::

    verdicts = Verdicts(store, wanted=[1, 2, 3])
    verdicts.look()                       # True, once the counter was read
    verdicts.gone                         # the members known gone
    verdicts.suspected(2, count=7)        # whether 2 is suspected, its heartbeat last read at 7
"""

from __future__ import annotations

from collections.abc import Collection

import torch.distributed as dist

from gradsync.elastic import keys
from gradsync.elastic.liveness import Liveness, beat_since, lost_mark


def post(store: dist.Store, key: str, mark: str) -> None:
    """Set a verdict's ``key`` to ``mark``, then move the counter: a leader that sees it move finds the mark set."""
    store.set(key, mark)
    store.add(keys.VERDICTS, 1)


def holds(store: dist.Store, key: str, member: int) -> bool:
    """Whether the mark at ``key`` is set and ``member``'s heartbeat has not moved since it was written (a stale
    mark, of a worker that was cut off and is back, holds against no one: :func:`~.liveness.lost_mark`)."""
    if not store.check([key]):
        return False
    return not beat_since(store.get(key).decode(), int(store.add(keys.beat(member), 0)))


class Verdicts:
    """The members of ``wanted`` known gone, and those only suspected, as posted so far; :meth:`look` reads the
    counter, and the marks again when it moved."""

    def __init__(self, store: dist.Store, wanted: list[int]) -> None:
        self._store, self._wanted = store, wanted
        self._count = self._verdicts()  # first: a verdict posted from here on moves the counter
        self.gone: set[int] = set()
        self._suspicions: dict[int, str] = {}  # member: the mark its watcher posted, still holding when read
        self._read()

    def look(self) -> bool:
        """One request: the counter; the marks only when it moved. Always True, a term of the leader's wait."""
        count = self._verdicts()
        if count != self._count:
            self._count = count
            self._read()
        return True

    def _read(self) -> None:
        store = self._store
        lost = lambda m: store.check([keys.exited(m)]) or holds(store, keys.lost(m), m)  # noqa: E731
        self.gone = {m for m in self._wanted if lost(m)}
        marks = {m: keys.suspected(m) for m in self._wanted if m not in self.gone}
        self._suspicions = {m: store.get(key).decode() for m, key in marks.items() if holds(store, key, m)}

    def suspected(self, member: int, count: int) -> bool:
        """Whether ``member``'s watcher posted a suspicion that still holds with its heartbeat read at ``count``
        (a live member wrongly suspected is awaited again once the leader sees it beat)."""
        mark = self._suspicions.get(member)
        return mark is not None and not beat_since(mark, count)

    def _verdicts(self) -> int:
        return int(self._store.add(keys.VERDICTS, 0))


class Suspicions:
    """The suspicions one member's heartbeat thread posts: each watched member of its round whose heartbeat it saw
    stand still for ``SUSPECT_BEATS`` beats, once per heartbeat count (a member that beats again and stops again
    is posted again)."""

    def __init__(self, liveness: Liveness) -> None:
        self._liveness = liveness
        self._posted: dict[int, int] = {}  # member: the count its last suspicion carried

    def post_new(self, store: dist.Store, members: Collection[int]) -> None:
        """From the heartbeat thread, each beat, on its own connection."""
        for member, still in self._liveness.suspects(members).items():
            if still == float("inf"):  # its exit was reported: a verdict already
                continue
            count = self._liveness.last_count(member)
            if self._posted.get(member) != count:
                self._posted[member] = count
                why = f"its watcher, worker {self._liveness.me}, saw its heartbeat stand still for {still:.1f}s"
                post(store, keys.suspected(member), lost_mark(count, why))
