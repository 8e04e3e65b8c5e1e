"""Join requests: a worker asking to be admitted takes a ticket (the ``join_requests`` counter) that names it, so a
round's leader reads only the requests made since the current round formed, not every worker the job ever started.

Every restarted worker takes a new number, so a week of faults leaves thousands of numbers behind; the leader used
to check two keys for each of them (``joiners/<n>``, ``joined/<n>``) each time it decided a round, on the critical
path of every recovery. A round resolves every request it saw (the joiner is a member, or marked expired and asks
again with a new ticket), so the requests since the current round's count (``round<k>/requests``) are all that can
be pending. :func:`every_pending` is the full scan, kept as the reference and as the fallback for a ticket taken but
not yet written.
"""

from __future__ import annotations

import torch.distributed as dist

from gradsync.elastic import keys, tickets


def ask(store: dist.Store, me: int) -> None:
    """Worker ``me`` asks to be admitted (again)."""
    store.set(keys.joiner(me), "1")  # first: a leader that counts the request finds the joiner marked
    tickets.take(store, keys.JOIN_REQUESTS, keys.ticket, me)


def pending(store: dist.Store, since: int | None) -> list[int]:
    """The workers asking to be admitted, not admitted yet, among the requests after the first ``since`` (the count
    the current round recorded); every pending one if a ticket was taken but not written yet, or with no count."""
    if since is None:
        return every_pending(store)
    count = int(store.add(keys.JOIN_REQUESTS, 0))
    asking = tickets.named_since(store, keys.ticket, since, count)
    if asking is None:  # a joiner between its count and its ticket
        return every_pending(store)
    return sorted(m for m in set(asking) if not store.check([keys.joined(m)]))


def every_pending(store: dist.Store) -> list[int]:
    """Every worker asking to be admitted and not admitted yet: two keys checked for each number ever taken."""
    count = int(store.add(keys.SEQUENCE, 0))
    check = store.check
    return [s for s in range(1, count + 1) if check([keys.joiner(s)]) and not check([keys.joined(s)])]
