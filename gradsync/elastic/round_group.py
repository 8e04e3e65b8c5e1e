"""A round's process group: a fresh default group on a store prefix of the round's own (``round<k>/group/``), with
no process restart, formed once every member is at the gate, whose members wait for no peer's report when a
collective fails (they recover themselves); and a lost member marked for the next round's leader.

**The gate** (:func:`arrive`, :func:`call_off`). torch's ``init_process_group`` exchanges the members' addresses
through the store and waits for each up to the group's timeout. A member that dies after the round was agreed (a
second fault inside one regroup window, or a kill its launcher reports a moment after the round's leader asked)
would make every survivor wait out that whole timeout inside ``init_process_group``, although its watcher already
knows it is gone. So each member first counts itself in; the last one in opens the gate, and a watcher that sees a
member of the round gone calls it off, whichever comes first (one ``compare_set`` decides). The members wait for
that decision with the store's blocking wait (a watch on etcd), not a poll, and only then form the group. A watcher
also calls the round off for a member whose heartbeat it saw stand still for 3 beats
(``RoundGroup.call_off_for_suspects``), before the heartbeat timeout would call it gone.

**The connect's bound** (:class:`ConnectTimeout`). A member lost in the milliseconds after the gate opened, inside
``init_process_group``, leaves the others waiting for its address until the group's timeout. Connecting grows with
the members and the store's load (each member reads every other's address), so no constant fits: the bound is
``MARGIN`` times the slowest connect measured here, at least ``FLOOR_S``, at most the collective timeout. It is the
group's timeout while it connects, which bounds the wait for each member's address in the store; gloo waits
``PEER_CONNECT_FACTOR`` times as long for a member that posted its address to connect (its tcp ``Pair`` "uses a
longer timeout when waiting for initial connect"), so the floor is divided by that factor: a member lost after
posting costs ``FLOOR_S x PEER_CONNECT_FACTOR``, 1 s. A process that measured none yet starts from the slowest
connect the members published (``keys.CONNECT_SLOWEST``): otherwise a joiner would wait the whole timeout for a
member lost as it joined, and hold the next round as long, as its leader waits for every live member. One with
nothing to start from (the job's first round), and one whose last connect failed with no member seen gone or still
meanwhile (a store too slow for the bound, rather than a member lost), waits the whole collective timeout, so that a
slow store costs one round, never a livelock. A connect that failed while a member was seen gone keeps its bound, so
that a second member lost in the next round costs the bound again, not the whole timeout. docs/elastic.md ("Under
chaos") measures each of these waits. The group then takes the collective timeout for its collectives
(``torch_private.set_group_timeout``); where torch cannot set it, the connect keeps the collective timeout too.

Example::

    arrive(store, round_, seconds=10)        # every member of round_, before init_process_group
    call_off(beat_store, round_.number, "worker 3 exited")   # its watcher, from the heartbeat thread
    clock = ConnectTimeout(collective=5.0)
    clock.seconds()          # 5.0: nothing measured yet
    clock.connected(0.02)
    clock.seconds()          # 0.2: FLOOR_S, above 4 x 0.02 s
"""

from __future__ import annotations

import contextlib
import datetime
import inspect
import sys
import time
from collections.abc import Callable, Collection

import torch.distributed as dist

from gradsync import torch_private
from gradsync.elastic import keys, verdicts
from gradsync.elastic.errors import MembershipChanged
from gradsync.elastic.timeouts import Timeouts
from gradsync.elastic.training_view import Round, TrainingView
from gradsync.elastic.verdicts import lost_mark

PEER_CONNECT_FACTOR = 5  # gloo's wait for a peer's connect, in times the group's timeout (gloo/transport/tcp/pair.h)
FLOOR_S = 1.0 / PEER_CONNECT_FACTOR  # a member lost after posting costs 1 s and a round more: within the 1.5 s p99 goal
MARGIN = 4.0  # over the slowest connect measured: a store busier than then still connects


class ConnectTimeout:
    """The connect's bound for the next round's group, from the connects of this process (see the module)."""

    def __init__(self, collective: float) -> None:
        self._collective = collective
        self._slowest: float | None = None
        self._fresh = True

    def seconds(self) -> float:
        if self._slowest is None:
            return self._collective
        return min(self._collective, max(FLOOR_S, MARGIN * self._slowest))

    def fresh(self) -> bool:
        """Nothing connected or failed here yet: :meth:`start_from` applies."""
        return self._fresh

    def start_from(self, published: float) -> None:
        """The slowest connect the job's members published, for a process that measured none yet."""
        if self._fresh:
            self._slowest, self._fresh = published, False

    def connected(self, seconds: float) -> bool:
        """A connect took ``seconds``; whether it was the slowest measured (then worth publishing)."""
        slowest, self._fresh = seconds > (self._slowest or 0.0), False
        self._slowest = max(seconds, self._slowest or 0.0)
        return slowest

    def failed(self) -> None:
        """A connect failed: the next one waits the collective timeout (it may have been the store, not a member)."""
        self._slowest, self._fresh = None, False


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
    decision = store.get(gate).decode()
    if decision != OPEN:
        raise MembershipChanged(f"round {round_.number}'s group was called off: {decision}")


def call_off(store: dist.Store, round_number: int, why: str) -> None:
    """A member of round ``round_number`` is gone (``why``): the members waiting in :func:`arrive` stop now. No-op
    once the gate opened: the group then forms, and its first collective fails instead."""
    store.compare_set(keys.gate(round_number), "", why)


def _peer_lost(exc: RuntimeError) -> bool:
    """Whether forming a group failed because a member is gone: the store's wait for its keys timed out (a
    ``DistError``), or gloo could not connect to the address it had posted (a plain ``RuntimeError`` from
    ``ProcessGroupGloo``'s constructor: "Gloo connectFullMesh failed with ... Connect timeout"). Either is a
    membership change, not this member's end: a peer whose link went down after the gate opened raises the second on
    every member of the round, which would otherwise all exit, and the job's state with them."""
    return isinstance(exc, dist.DistError) or "connectFullMesh" in str(exc)


def _release_frames(failure: BaseException) -> None:
    """Clear the local variables of the finished frames in ``failure``'s tracebacks (and its causes').

    ``destroy_process_group`` closes a gloo group's connections only when the group object itself goes: gloo's
    ``shutdown`` and ``abort`` leave them open. A failed collective's traceback keeps the frames it passed through,
    and their locals keep the group (torch's ``all_gather_object`` holds ``group``, our ``Communicator`` the
    ``work``, whose gloo context owns the connections). So while the failure was held, as a recovery holds it,
    the members waiting on this one would not be released by its leaving: they would wait in the next round's first
    collectives up to the collective timeout (docs/elastic.md, "Under chaos"). The message and the traceback's lines
    stay; only the locals go. A generator's frame is left alone: clearing it would close the generator, and a
    suspended one (a data loader's) is the user's to resume."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [failure]
    while pending:
        exc = pending.pop()
        if exc is None or id(exc) in seen:
            continue
        seen.add(id(exc))
        tb = exc.__traceback__
        while tb is not None:
            if not tb.tb_frame.f_code.co_flags & _GENERATOR_FLAGS:
                with contextlib.suppress(RuntimeError):  # a frame still executing (the recovery's callers) stays
                    tb.tb_frame.clear()
            tb = tb.tb_next
        pending += [exc.__cause__, exc.__context__]


_GENERATOR_FLAGS = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR


class RoundGroup:
    """The current round's process group, formed over the job's ``store`` with the ``timeouts``' collective one
    (a collective with a stopped member fails after it). ``alarm_store``: the heartbeat thread's own connection,
    on which :meth:`tell_members` calls a forming round off (the training thread's waits on ``store``)."""

    def __init__(
        self, store: dist.Store, timeouts: Timeouts, alarm_store: dist.Store, view: TrainingView | None = None
    ) -> None:
        self._store = store
        self._alarm_store = alarm_store
        self._timeouts = timeouts
        self._connect_timeout = ConnectTimeout(timeouts.collective)
        self._view = view if view is not None else TrainingView()  # the round forming and formed, for the beat thread
        self._excepthook = sys.excepthook  # as the process had it, before any round's group wrapped it

    def leave(self, failure: BaseException | None = None) -> None:
        """Close the current round's group, at once, before the next round is agreed; ``failure``, the error that
        ended the round, first lets go of the group (:func:`_release_frames`).

        Gloo cannot abort a collective: a member whose peers are all alive waits in it until the group's timeout,
        even after a neighbour's collective failed because a member died (only the dead member's neighbours see
        its connection close; a ring or tree step waiting on a survivor does not). Closing the group closes this
        member's connections, so the members still waiting on it fail within milliseconds, and close theirs in
        turn, instead of waiting out the group's timeout (tests/test_round_leave.py; measured in docs/elastic.md). A
        group with dead members may not close cleanly; it is dropped either way."""
        if failure is not None:
            _release_frames(failure)
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass

    def form(self, round_: Round) -> None:
        """A fresh default process group for ``round_`` (the previous one, if any, is closed first)."""
        self.leave()
        with self._view.forming(round_):
            arrive(self._store, round_, self._timeouts.collective)  # or called off: a member is gone
            self._init_group(round_)
        self._view.formed(round_)

    def _init_group(self, round_: Round) -> None:
        """Connect within :class:`ConnectTimeout`'s bound (a member lost after the gate opened
        costs that, not the collective timeout), then give the group the collective timeout."""
        collective, bound = self._timeouts.collective, self._connect_timeout
        if bound.fresh() and self._store.check([keys.CONNECT_SLOWEST]):
            bound.start_from(float(self._store.get(keys.CONNECT_SLOWEST)))  # a joiner: the members' measure
        seconds = bound.seconds() if torch_private.group_timeout_settable() else collective
        try:
            took = self._connect(round_, seconds)
        except MembershipChanged:
            if not self._view.was_lost_while_forming(round_.number):  # a lost member explains it, not the bound
                bound.failed()
            raise
        if bound.connected(took):
            self._store.set(keys.CONNECT_SLOWEST, f"{took:.4f}")
        if seconds != collective:
            torch_private.set_group_timeout(collective)  # before any collective: a stopped member is found within it

    def _connect(self, round_: Round, seconds: float) -> float:
        """Form the group within ``seconds``; how long it took (a failure says so too)."""
        prefix = dist.PrefixStore(keys.group_prefix(round_.number), self._store)
        # init_process_group wraps sys.excepthook in one that prefixes "[rank<r>]: " to each line, around whatever
        # hook was there: wrapped again each round, a worker's traceback would bear one prefix per round, of ranks it
        # no longer has. Each round wraps the hook the process started with, once.
        sys.excepthook = self._excepthook
        began = time.monotonic()
        try:
            dist.init_process_group(
                "gloo",
                store=prefix,
                rank=round_.rank,
                world_size=round_.world_size,
                timeout=datetime.timedelta(seconds=seconds),
            )
        except RuntimeError as exc:
            if not _peer_lost(exc):
                raise
            # A member died while the group formed: the next round goes without it.
            # The default group's store keys carry a per-process counter of groups made, which
            # destroy_process_group resets to 0 "to allow consistent value ... after some trainers recover from
            # failure" (torch/distributed/distributed_c10d.py). A failed init bumps it with no group to destroy:
            # reset it too, or this worker's keys never match the others' again.
            torch_private.reset_group_count()
            bound = f" within its connect bound, {seconds:.2g}s" if seconds < self._timeouts.collective else ""
            took = f" after {time.monotonic() - began:.2f}s"
            raise MembershipChanged(f"forming round {round_.number}'s group failed{bound}{took}: {exc}") from exc
        return time.monotonic() - began

    def call_off_for_suspects(self, suspects: Callable[[Collection[int]], dict[int, float]]) -> None:
        """From the heartbeat thread, each beat: a member of the round being formed that ``suspects`` names (its
        heartbeat stood still for 3 beats: :meth:`~.liveness.Liveness.suspects`) calls the round off at once. The
        gate would wait the collective timeout for it otherwise, as no watcher calls it gone before the heartbeat
        timeout. A live member wrongly suspected costs one more round, never a wrong one: the next round's leader
        does not wait for it, and its heartbeat moves again."""
        forming = self._view.seen().forming
        if forming is None:
            return
        for member, still in suspects(forming.members).items():
            self._view.lost_while_forming(forming.number)
            why = f"worker {member}'s heartbeat stood still for {still:.1f}s as the round formed"
            call_off(self._alarm_store, forming.number, why)
            return

    def tell_members(self, member: int, why: str, count: int) -> None:
        """From the heartbeat thread: a member of this round is gone. A member of the round being formed calls that
        round off (:func:`call_off`): its members would otherwise wait out the group's timeout. A member of the
        current round is marked lost for the next round's leader, with ``count``, its heartbeat counter as last seen
        (:func:`~.verdicts.lost_mark`). Both on the heartbeat thread's own connection: a TCPStore client serves one
        request at a time, and the training thread's may be inside a wait of seconds (the gate, the group's
        rendezvous, the next member list); this thread's beats would stop behind it, and its member, looking dead
        after 3 beats, would be left out of rounds."""
        seen = self._view.seen()
        forming, formed = seen.forming, seen.formed
        if forming is not None and member in forming.members:
            self._view.lost_while_forming(forming.number)
            call_off(self._alarm_store, forming.number, f"worker {member} {why}")
        if formed is not None and member in formed.members:
            verdicts.post(self._alarm_store, keys.lost(member), lost_mark(count, why), member)  # for the next leader
