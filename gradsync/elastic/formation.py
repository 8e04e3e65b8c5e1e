"""The gate before a round's process group forms: every member arrives, or the round is called off at once.

torch's ``init_process_group`` exchanges the members' addresses through the store and waits for each up to the
group's timeout. A member that dies after the round was agreed (a second fault inside one regroup window, or a kill
its launcher reports a moment after the round's leader asked) would make every survivor wait out that whole timeout
inside ``init_process_group``, although its watcher already knows it is gone.

So each member first counts itself in; the last one in opens the gate, and a watcher that sees a member of the round
gone calls it off, whichever comes first (one ``compare_set`` decides). The members wait for that decision with the
store's blocking wait (a watch on etcd), not a poll, and only then form the group. A watcher also calls the round off
for a member whose heartbeat it saw stand still for 3 beats (``RoundGroup.call_off_for_suspects``), before the
heartbeat timeout would call it gone. A member lost between the gate opening and the group's connect, milliseconds
later, costs the connect's own bound (:mod:`.connect_timeout`: a few measured connects, at least ``FLOOR_S``).

Example::

    arrive(store, round_, seconds=10)        # every member of round_, before init_process_group
    call_off(beat_store, round_.number, "worker 3 exited")   # its watcher, from the heartbeat thread
"""

from __future__ import annotations

import datetime

import torch.distributed as dist

from gradsync.elastic import keys
from gradsync.elastic.errors import MembershipChanged
from gradsync.elastic.rounds import Round

OPEN = "open"


def arrive(store: dist.Store, round_: Round, seconds: float) -> None:
    """Count this member in and wait, at most ``seconds``, until every member of ``round_`` has (then return) or
    the round is called off (then raise :class:`MembershipChanged`, for the next round to go without the lost)."""
    gate = keys.gate(round_.number)
    if store.add(keys.arrived(round_.number), 1) == round_.world_size:
        store.compare_set(gate, "", OPEN)
    try:
        store.wait([gate], datetime.timedelta(seconds=seconds))
    except dist.DistError as exc:
        arrived = store.add(keys.arrived(round_.number), 0)
        raise MembershipChanged(
            f"round {round_.number}: {arrived} of its {round_.world_size} members reached its group within "
            f"{seconds:.0f}s and no watcher saw one gone ({exc})"
        ) from exc
    verdict = store.get(gate).decode()
    if verdict != OPEN:
        raise MembershipChanged(f"round {round_.number}'s group was called off: {verdict}")


def call_off(store: dist.Store, round_number: int, why: str) -> None:
    """A member of round ``round_number`` is gone (``why``): the members waiting in :func:`arrive` stop now. No-op
    once the gate opened: the group then forms, and its first collective fails instead."""
    store.compare_set(keys.gate(round_number), "", why)
