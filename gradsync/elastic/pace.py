"""Which member sets the job's pace: a straggler is kept and reported, never evicted.

A member slower than the others (a degraded GPU, a busy host, slow data loading) is still training: leaving it out
would drop its share of the data and its compute, and it would ask to join again at once. So nothing here changes
the membership; the job only says who it waits on. Each member's heartbeat thread posts, every ``PACE_S``, the
share of that window its training thread spent outside every collective (``pace/<member>``, from
:mod:`gradsync.collectives.activity`): computing, or loading data. The others spend the rest of theirs inside the
gradient all-reduce, waiting for the straggler's gradients. The round's rank 0 reads every member's share each window
and says once, when one member is busy nearly all the time and the others' median is far less, which member it is.

Example::

    straggler({1: 0.34, 2: 0.98, 3: 0.31})   # 2: the others waited for it about two thirds of the time
"""

from __future__ import annotations

import statistics
import time

import torch.distributed as dist

from gradsync.collectives.activity import CollectiveActivity
from gradsync.elastic import keys
from gradsync.elastic.rounds import Round
from gradsync.log import log

# A window: each member posts its share once a window, and rank 0 reads them (1 + N requests): the heartbeats make 3 N
# requests every 0.1 s (docs/scaling.md), 300 N a window.
PACE_S = 10.0
BUSY = 0.9  # a straggler spends at least this share of the window outside collectives
GAP = 0.3  # and the other members' median share is this much lower at least (they wait for it)


def straggler(busy: dict[int, float]) -> int | None:
    """The member the others wait on, from each member's share of time outside collectives; None when the pace is
    even (a member 3 x slower than the others: about 1.0 against 0.33).

    >>> straggler({1: 0.34, 2: 0.98, 3: 0.31}), straggler({1: 0.95, 2: 0.97, 3: 0.93}), straggler({1: 0.99})
    (2, None, None)
    """
    if len(busy) < 2:
        return None
    slowest = max(busy, key=lambda member: busy[member])
    others = statistics.median(share for member, share in busy.items() if member != slowest)
    return slowest if busy[slowest] >= BUSY and busy[slowest] - others >= GAP else None


class Pace:
    """One member's side, from its heartbeat thread each beat (:meth:`look`): its own share posted each window,
    and, on the round's rank 0, the straggler said once while it lasts."""

    def __init__(self, me: int, activity: CollectiveActivity) -> None:
        self._me = me
        self._activity = activity
        self._window = (time.monotonic(), activity.outside_total())  # when it began, and the time outside then
        self._said: int | None = None  # the straggler last reported
        self._posted = False

    def look(self, store: dist.Store, round_: Round | None) -> None:
        began, outside = self._window
        now, outside_now = time.monotonic(), self._activity.outside_total()
        # Posted at the first beat too: the member's key then exists from its start, so the store holds as many keys
        # after a few steps as after many (tests/test_elastic.py counts them).
        if self._posted and now - began < PACE_S:
            return
        self._posted = True
        self._window = (now, outside_now)
        store.set(keys.pace(self._me), f"{(outside_now - outside) / (now - began):.3f}")
        if round_ is not None and round_.rank == 0:
            self._judge(store, round_)

    def _judge(self, store: dist.Store, round_: Round) -> None:
        everyone = [keys.pace(m) for m in round_.members]
        # One request when every member has posted; a joiner posts only after its first window.
        posted = round_.members if store.check(everyone) else [m for m in round_.members if store.check([keys.pace(m)])]
        busy = {m: float(store.get(keys.pace(m))) for m in posted}
        slow = straggler(busy)
        if slow is not None and slow != self._said:
            others = statistics.median(share for m, share in busy.items() if m != slow)
            log.warning(
                "gradsync elastic: worker %d (rank %d) sets the job's pace: its training thread spent %.0f%% of the "
                "last %gs outside collectives, the other members %.0f%% (the median; they waited for it inside them "
                "the rest). It is kept: a slower member still trains its share",
                slow,
                round_.members.index(slow),
                100 * busy[slow],
                PACE_S,
                100 * others,
            )
        self._said = slow
