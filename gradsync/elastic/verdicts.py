"""What a deciding round leader knows of the members it wants beyond its own heartbeat reads: the verdicts others
posted in the store. A member is *gone* when its launcher reported its exit (``exited/<member>``) or its watcher
declared it lost at the heartbeat timeout (``lost/<member>``); it is *suspected* when its watcher saw its heartbeat
stand still for ``SUSPECT_BEATS`` beats (``suspected/<member>``, :class:`Suspicions`); it is *stalled* when its own
heartbeat thread saw its training thread outside every collective for longer than the collective timeout
(``stalled/<member>``, :class:`Stall`): a step stuck in user code, which the leader need not wait for.

A suspicion posted by the watcher is what lets a host lost whole (no launcher left to report the exit) cost the
watcher's three still beats, counted since the member's last beat, not three more beats counted from the moment the
leader first looks: the leader had not watched that member before the round began, so its own count starts only then
(docs/elastic.md, "Under chaos", measures the difference). A mark carries the heartbeat count its writer last saw,
so it expires once the member beats again (:func:`beat_since`): a live member wrongly suspected is awaited again at
its next beat.

Each verdict takes a ticket naming its member (the ``verdicts`` counter, ``verdicts/<k>``): a leader reads the
counter each look (one request) and only the members named by the tickets since the current round formed, not three
keys of every member it wants (3 N requests, on the critical path of every regroup). :meth:`Verdicts.read_all` is
the full read, kept as the reference and as the fallback where no count was recorded or a ticket was taken but not
written yet.

A worker asking to join is posted here too, the same way (:func:`ask_to_join`, the ``join_requests`` counter): every
thing posted about a member is in this file. Every restarted worker takes a new number, so a week of faults leaves
thousands of numbers behind; a round resolves every request it saw (the joiner is a member, or marked expired and
asks again with a new ticket), so the requests since the current round's count (``round<k>/requests``) are all that
can be pending (:func:`joiners_pending`; :func:`every_joiner_pending` is the full scan, reference and fallback).

A ticket is a counter in the store whose k-th increment names a worker (:func:`take_ticket`): a reader who recorded
the count once reads only what was posted since (:func:`tickets_since`), not a key of every worker. A ticket is
written after its count moved, so a reader can find one counted but not written yet: it then falls back to its full
read (the thing the ticket is about was set before the count moved).

Example::

    verdicts = Verdicts(store, wanted=[1, 2, 3], since=None)
    verdicts.look()                       # True, once the counter was read
    verdicts.gone                         # the members known gone
    verdicts.suspected(2, count=7)        # whether 2 is suspected, its heartbeat last read at 7
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING

import torch.distributed as dist

from gradsync.elastic import keys

if TYPE_CHECKING:
    from gradsync.collectives.activity import CollectiveActivity
    from gradsync.elastic.liveness import Liveness


def mark_exited(store: dist.Store, member: int) -> None:
    """A launcher saw ``member``'s process exit: for a round's leader, which asks about each candidate once
    (``exited/<member>``), and for the member watching it, which reads only the counter (the process is gone, so
    no beat of its own can follow)."""
    post(store, keys.exited(member), "1", member)  # for a deciding leader, at its next look
    store.set(keys.beat(member), str(keys.EXITED_BEAT))


def take_ticket(store: dist.Store, counter: str, ticket: Callable[[int], str], worker: int) -> None:
    """Move ``counter`` and write the ticket it gave, naming ``worker``."""
    number = int(store.add(counter, 1))
    store.set(ticket(number), str(worker))


def tickets_since(store: dist.Store, ticket: Callable[[int], str], since: int, count: int) -> list[int] | None:
    """The workers the tickets after the first ``since``, up to ``count``, name; None if one of them is counted but
    not written yet."""
    names = [ticket(number) for number in range(since + 1, count + 1)]  # not `keys`: that is the schema module
    if names and not store.check(names):
        return None
    return [int(store.get(name)) for name in names]


def ask_to_join(store: dist.Store, me: int) -> None:
    """Worker ``me`` asks to be admitted (again)."""
    store.set(keys.joiner(me), "1")  # first: a leader that counts the request finds the joiner marked
    take_ticket(store, keys.JOIN_REQUESTS, keys.ticket, me)


def joiners_pending(store: dist.Store, since: int | None) -> list[int]:
    """The workers asking to be admitted, not admitted yet, among the requests after the first ``since`` (the count
    the current round recorded); every pending one if a ticket was taken but not written yet, or with no count."""
    if since is None:
        return every_joiner_pending(store)
    count = int(store.add(keys.JOIN_REQUESTS, 0))
    asking = tickets_since(store, keys.ticket, since, count)
    if asking is None:  # a joiner between its count and its ticket
        return every_joiner_pending(store)
    return sorted(m for m in set(asking) if not store.check([keys.joined(m)]))


def every_joiner_pending(store: dist.Store) -> list[int]:
    """Every worker asking to be admitted and not admitted yet: two keys checked for each number ever taken."""
    count = int(store.add(keys.SEQUENCE, 0))
    check = store.check
    return [s for s in range(1, count + 1) if check([keys.joiner(s)]) and not check([keys.joined(s)])]


def lost_mark(count: int, why: str) -> str:
    """A verdict's value (``lost/<member>``, ``suspected/<member>``): the heartbeat count its watcher last saw,
    then why. The count makes the mark expire: a worker cut off for a while (a link down, a split) comes back
    in-process with the same number, and a mark written after it had deleted it would otherwise leave it out of
    every round after, its heartbeat moving all along."""
    return f"{count} {why}"


def beat_since(mark: str, count: int) -> bool:
    """Whether the member beat after its watcher wrote ``mark`` (``count``: its counter now)."""
    seen, _, _ = mark.partition(" ")
    return seen.lstrip("-").isdigit() and count > int(seen)


def post(store: dist.Store, key: str, mark: str, member: int) -> None:
    """Set a verdict on ``member`` (``key`` to ``mark``), then take its ticket: a leader that sees the counter move
    finds the mark set, even before the ticket is written."""
    store.set(key, mark)
    take_ticket(store, keys.VERDICTS, keys.verdict, member)


def withdraw(store: dist.Store, key: str, member: int) -> None:
    """Delete the verdict at ``key`` on ``member``, then take a ticket as :func:`post` does: a leader reads the
    member's marks again, and finds this one gone."""
    store.delete_key(key)
    take_ticket(store, keys.VERDICTS, keys.verdict, member)


def holding(store: dist.Store, key: str, member: int) -> str | None:
    """The mark at ``key``, if it is set and ``member``'s heartbeat has not moved since it was written (a stale
    mark, of a worker that was cut off and is back, holds against no one: :func:`lost_mark`)."""
    if not store.check([key]):
        return None
    mark = store.get(key).decode()
    return None if beat_since(mark, int(store.add(keys.beat(member), 0))) else mark


class Verdicts:
    """The members of ``wanted`` known gone, and the suspicions posted on them, from the verdicts after the first
    ``since`` (the count the current round recorded; None: every mark); :meth:`look` reads the counter, and the
    members its new tickets name."""

    def __init__(self, store: dist.Store, wanted: list[int], since: int | None) -> None:
        self._store, self._wanted = store, wanted
        self.gone: set[int] = set()
        self.stalled: dict[int, str] = {}  # member: why its training thread is stalled, as it said
        self._suspicions: dict[int, str] = {}  # member: the mark its watcher posted, holding when it was read
        if since is None:
            self.count = self.counter()  # first: a verdict posted from here on moves it
            self.read_all()
        else:
            self.count = since
            self.look()

    def counter(self) -> int:
        """The verdicts posted so far, in all."""
        return int(self._store.add(keys.VERDICTS, 0))

    def look(self) -> bool:
        """One request: the counter; the members its new tickets name only when it moved. Always True, a term of
        the leader's wait."""
        count = self.counter()
        if count != self.count:
            named = tickets_since(self._store, keys.verdict, self.count, count)
            if named is None:  # a verdict between its count and its ticket: its mark is set, a full read finds it
                self.read_all()
            else:
                self._read([m for m in self._wanted if m in named])
            self.count = count
        return True

    def read_all(self) -> None:
        """Every mark of every member wanted: four keys each."""
        self._read(self._wanted)

    def _read(self, members: list[int]) -> None:
        """The marks of ``members`` as they are now: an exit, a loss, a suspicion that holds, a stall."""
        store = self._store
        for member in members:
            self.gone.discard(member)
            self._suspicions.pop(member, None)
            self.stalled.pop(member, None)
            if store.check([keys.exited(member)]) or holding(store, keys.lost(member), member) is not None:
                self.gone.add(member)
                continue
            if (mark := holding(store, keys.suspected(member), member)) is not None:
                self._suspicions[member] = mark
            if store.check([keys.stalled(member)]):
                self.stalled[member] = store.get(keys.stalled(member)).decode()

    def suspected(self, member: int, count: int) -> bool:
        """Whether ``member``'s watcher posted a suspicion that still holds with its heartbeat read at ``count``
        (a live member wrongly suspected is awaited again once the leader sees it beat)."""
        mark = self._suspicions.get(member)
        return mark is not None and not beat_since(mark, count)


class Suspicions:
    """The suspicions one member's heartbeat thread posts: each watched member of its round whose heartbeat it saw
    stand still for ``SUSPECT_BEATS`` beats, once a round per heartbeat count (a member that beats again and stops
    again is posted again; one suspected, listed anyway, and still in the next round too, whose leader reads only
    the verdicts since this one formed)."""

    def __init__(self, liveness: Liveness) -> None:
        self._liveness = liveness
        self._round = 0
        self._posted: dict[int, int] = {}  # member: the count its last suspicion this round carried

    def post_new(self, store: dist.Store, round_number: int, members: Collection[int]) -> None:
        """From the heartbeat thread, each beat, on its own connection: for round ``round_number`` of ``members``."""
        if round_number != self._round:
            self._round, self._posted = round_number, {}
        for member, still in self._liveness.suspects(members).items():
            if still == float("inf"):  # its exit was reported: a verdict already
                continue
            count = self._liveness.last_count(member)
            if self._posted.get(member) != count:
                self._posted[member] = count
                why = f"its watcher, worker {self._liveness.me}, saw its heartbeat stand still for {still:.1f}s"
                post(store, keys.suspected(member), lost_mark(count, why), member)


class Stall:
    """This worker's own verdict, from its heartbeat thread each beat: its training thread has been outside every
    collective for longer than the collective timeout (:mod:`gradsync.collectives.activity`), so no peer can still be
    inside one with it: it is stuck in a step (user code, a data loader, a file system) while its heartbeat beats.
    Posted once (``stalled/<me>``, with a ticket, as every verdict), so that a round's leader does not wait for it
    to register; deleted, with a ticket again, once it touches a collective.

    While it stands, the beat also looks whether the job finished (``done``): a TCPStore closes with the job, and the
    training thread, when it wakes, could not tell a finished job from a lost store. ``job_finished`` is how it can."""

    def __init__(self, me: int, activity: CollectiveActivity, seconds: float) -> None:
        self._me = me
        self._activity = activity
        self._seconds = seconds
        self._posted = False
        self.job_finished = threading.Event()

    def look(self, store: dist.Store) -> None:
        outside = self._activity.outside_for()
        stalled = outside is not None and outside > self._seconds
        if stalled and not self._posted:
            why = f"its training thread had been outside every collective for {outside:.1f}s"
            post(store, keys.stalled(self._me), why, self._me)
            self._posted = True
        elif self._posted and not stalled:
            withdraw(store, keys.stalled(self._me), self._me)
            self._posted = False
        if stalled and store.check([keys.DONE]):
            self.job_finished.set()
