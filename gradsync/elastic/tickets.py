"""Tickets: a counter in the job's store whose k-th increment names a worker (``<counter>`` and ``<ticket>(k)``), so
that a reader who recorded the count once reads only what was posted since, not a key of every worker.

Join requests (:mod:`.join_requests`) and verdicts on members (:mod:`.verdicts`) are both posted this way: a round's
leader records each count as it decides, and the next leader reads the tickets after it. A ticket is written after
its count moved, so a reader can find one counted but not written yet: :func:`named_since` then returns None, and
the caller falls back to its full read (the thing the ticket is about was set before the count moved).

Example::

    store = torch.distributed.HashStore()
    take(store, "requests", lambda k: f"requests/{k}", worker=7)
    named_since(store, lambda k: f"requests/{k}", since=0, count=1)   # [7]
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist


def take(store: dist.Store, counter: str, ticket: Callable[[int], str], worker: int) -> None:
    """Move ``counter`` and write the ticket it gave, naming ``worker``."""
    number = int(store.add(counter, 1))
    store.set(ticket(number), str(worker))


def named_since(store: dist.Store, ticket: Callable[[int], str], since: int, count: int) -> list[int] | None:
    """The workers the tickets after the first ``since``, up to ``count``, name; None if one of them is counted but
    not written yet."""
    keys = [ticket(number) for number in range(since + 1, count + 1)]
    if keys and not store.check(keys):
        return None
    return [int(store.get(key)) for key in keys]
