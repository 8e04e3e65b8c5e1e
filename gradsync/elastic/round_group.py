"""A round's process group: a fresh default group on a store prefix of the round's own (``round<k>/group/``), with
no process restart, formed once every member is at the gate (:mod:`.formation`), whose members wait for no peer's
report when a collective fails (they recover themselves); and a lost member marked for the next round's leader."""

from __future__ import annotations

import contextlib
import datetime
import inspect
import sys
import time
from collections.abc import Callable, Collection

import torch.distributed as dist

from gradsync import torch_private
from gradsync.elastic import formation, keys, verdicts
from gradsync.elastic.connect_timeout import ConnectTimeout
from gradsync.elastic.errors import MembershipChanged
from gradsync.elastic.rounds import Round
from gradsync.elastic.timeouts import Timeouts
from gradsync.elastic.verdicts import lost_mark


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

    def __init__(self, store: dist.Store, timeouts: Timeouts, alarm_store: dist.Store) -> None:
        self._store = store
        self._alarm_store = alarm_store
        self._timeouts = timeouts
        self._connect_timeout = ConnectTimeout(timeouts.collective)
        self._formed: Round | None = None  # the current round, once its group formed, read by the heartbeat thread
        self._forming: Round | None = None  # the round whose group is being formed, read by the heartbeat thread
        # The round the heartbeat thread saw a member of gone or still as it formed: a number, so that a late write
        # about an earlier round never counts against the one forming now.
        self._lost_while_forming: int | None = None
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
        self._forming = round_
        try:
            formation.arrive(self._store, round_, self._timeouts.collective)  # or called off: a member is gone
            self._init_group(round_)
        finally:
            self._forming = None
        self._formed = round_

    def _init_group(self, round_: Round) -> None:
        """Connect within :class:`~.connect_timeout.ConnectTimeout`'s bound (a member lost after the gate opened
        costs that, not the collective timeout), then give the group the collective timeout."""
        collective, bound = self._timeouts.collective, self._connect_timeout
        if bound.fresh() and self._store.check([keys.CONNECT_SLOWEST]):
            bound.start_from(float(self._store.get(keys.CONNECT_SLOWEST)))  # a joiner: the members' measure
        seconds = bound.seconds() if torch_private.group_timeout_settable() else collective
        try:
            took = self._connect(round_, seconds)
        except MembershipChanged:
            if self._lost_while_forming != round_.number:  # a lost member explains the failure, not too short a bound
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
        forming = self._forming
        if forming is None:
            return
        for member, still in suspects(forming.members).items():
            self._lost_while_forming = forming.number
            why = f"worker {member}'s heartbeat stood still for {still:.1f}s as the round formed"
            formation.call_off(self._alarm_store, forming.number, why)
            return

    def tell_members(self, member: int, why: str, count: int) -> None:
        """From the heartbeat thread: a member of this round is gone. A member of the round being formed calls that
        round off (:mod:`.formation`): its members would otherwise wait out the group's timeout. A member of the
        current round is marked lost for the next round's leader, with ``count``, its heartbeat counter as last seen
        (:func:`~.verdicts.lost_mark`). Both on the heartbeat thread's own connection: a TCPStore client serves one
        request at a time, and the training thread's may be inside a wait of seconds (the gate, the group's
        rendezvous, the next member list); this thread's beats would stop behind it, and its member, looking dead
        after 3 beats, would be left out of rounds."""
        forming = self._forming
        if forming is not None and member in forming.members:
            self._lost_while_forming = forming.number
            formation.call_off(self._alarm_store, forming.number, f"worker {member} {why}")
        formed = self._formed
        if formed is not None and member in formed.members:
            verdicts.post(self._alarm_store, keys.lost(member), lost_mark(count, why), member)  # for the next leader
