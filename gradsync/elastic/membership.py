"""Who is in the job: the members of each round, and the process group formed for a round.

All coordination goes through the job's key-value store (a TCPStore the elastic launcher hosts, outside every
worker, so a dead worker takes no state with it; or an etcd cluster, so a dead host takes none either:
:mod:`gradsync.elastic.job_store`; its keys: :mod:`gradsync.elastic.keys`). Each worker gets a
sequence number when it first arrives; the members of a round, in sequence order, are its ranks, so survivors keep
their relative order and newcomers come last. Who is alive is :mod:`gradsync.elastic.liveness`'s question
(heartbeats, and exits reported by launchers).

A round: every live worker registers (with the steps it committed); the first to claim the round's leadership
(``compare_set``) waits until every live member registered (a live one may first have to time out of a
collective), then writes the round's member list, the member with the most committed steps first; everyone reads
it, and each member forms a fresh gloo group on a store prefix of its own (``round<k>/group/``), with no process
restart. A round whose leader dies before naming the members is skipped.

Between rounds the store is not touched per step (:meth:`Membership.step_boundary`): a step is committed when its
gradients' all-reduce completed, which every member's backward took part in, and a worker asking to join is
admitted at a step boundary rank 0 announces a few steps ahead.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import time
from dataclasses import dataclass

import torch.distributed as dist

from gradsync import settings, torch_private
from gradsync.collectives.peer_errors import post_gone
from gradsync.elastic import job_store, keys
from gradsync.elastic.admission import Admission
from gradsync.elastic.liveness import HEARTBEAT_S, Liveness, mark_exited
from gradsync.errors import GradsyncError
from gradsync.polling import wait_until

STORE_VARIABLE = "GRADSYNC_ELASTIC_STORE"  # the job's store (host:port, or etcd://...), set by `gradsync run --elastic`
WORKER_VARIABLE = "GRADSYNC_ELASTIC_WORKER"  # this process's id, so that its launcher can report its exit
SETTLE_S = 1.0
SUSPECT_S = 4 * HEARTBEAT_S  # a member silent this long while a round is decided is not waited for
log = logging.getLogger("gradsync")


class MembershipChanged(GradsyncError):
    """A member died, stalled or a worker asked to join: the group must be formed again (handled by elastic.run).

    Example::

        try:
            raise MembershipChanged("rank 2 stopped")   # what a step raises when a member is lost
        except gradsync.GradsyncError as error:       # elastic.run and State.guard() catch it for you
            print(error)
    """


class JobFinished(GradsyncError):
    """A worker started (or restarted) too late: the others already finished the training. ``elastic.init``
    returns no job then, and ``elastic.run`` returns None: nothing is left to do.

    Example::

        job = gradsync.elastic.init(timeout=10)
        if job.finished_without_me:   # init caught JobFinished: the others are done, nothing is left to do
            raise SystemExit(0)
    """


@dataclass(frozen=True)
class Round:
    number: int
    members: list[int]  # sequence numbers, in rank order
    me: int

    @property
    def rank(self) -> int:
        return self.members.index(self.me)

    @property
    def world_size(self) -> int:
        return len(self.members)


class Membership:
    """This worker's view of the job; ``connect()`` from the environment ``gradsync run --elastic`` sets.

    Example::

        job = gradsync.elastic.init(timeout=10)   # this worker's Membership
        if not job.finished_without_me:           # True for a worker started after the others finished
            print(f"a member lost for {job.timeout} s is left out")
        job.finished()
    """

    def __init__(self, store: dist.Store, beat_store: dist.Store, timeouts: Timeouts, where: str = "") -> None:
        self.store = store
        self.where = where  # how the store was reached, for messages
        self.timeouts = timeouts
        self.me = store.add(keys.SEQUENCE, 1)
        if os.environ.get(WORKER_VARIABLE):
            store.set(keys.worker(os.environ[WORKER_VARIABLE]), str(self.me))
        self.round: Round | None = None
        self.joined_late = False  # admitted into a running job: it receives the members' state first
        self._tried = 0  # the last round number this worker registered for
        self._group_store: tuple[Round, dist.Store] | None = None  # the current round's group store, as torch has it
        self._admission: tuple[Round, Admission] | None = None  # the current round's, read by the heartbeat thread
        self._finished_without_me = False
        self.liveness = Liveness(
            beat_store, self.me, timeouts.heartbeat, on_gone=self._tell_members, on_beat=self._look_for_admission
        )

    @property
    def finished_without_me(self) -> bool:
        """The job finished before this worker could join (see :meth:`finish_without_me`)."""
        return self._finished_without_me

    def finish_without_me(self, why: JobFinished) -> None:
        """Nothing is left for this worker: it stops watching, and ``elastic.run`` returns None."""
        self._finished_without_me = True
        self.stop()
        log.warning("gradsync elastic: %s; nothing left to do", why)

    @property
    def timeout(self) -> float:
        """Seconds without a heartbeat after which a member counts as lost."""
        return self.timeouts.heartbeat

    @classmethod
    def connect(cls, timeouts: Timeouts) -> Membership:
        where = os.environ.get(STORE_VARIABLE)
        if not where:
            raise GradsyncError(
                f"elastic training needs the job's store: start the job with `gradsync run --elastic ...` (it sets "
                f"{STORE_VARIABLE})."
            )
        # Two clients: the heartbeat thread never shares a connection with the training thread.
        store, beat_store = job_store.open_stores(where, 2)
        return cls(store, beat_store, timeouts, where)

    def stop(self) -> None:
        self.liveness.stop()

    def finished(self) -> None:
        """This worker's training function returned: the store host may close once every member has."""
        self.store.set(keys.DONE, "1")  # a worker still waiting to join need not
        self.store.add(keys.FINISHED, 1)
        self.stop()

    def job_done(self) -> bool:
        return job_done(self.store)

    # ------------------------------------------------------------------------------------------- joining
    def job_running(self) -> bool:
        return self.store.check([keys.CURRENT_ROUND])

    def first_round(self, expected: int, seconds: float = 300.0) -> Round:
        """The job's first round: the first worker to arrive waits for ``expected`` in all (at most ``seconds``).
        A worker that took a number and died before registering (its heartbeat never moves) is left out."""
        self.store.set(keys.registered(1, self.me), "0")
        if self.me == 1:
            wait_until(lambda: self._arrived() >= expected, seconds)
            numbers = range(1, self._arrived() + 1)
            registered = lambda s: self._registered(1, s)  # noqa: E731
            wait_until(lambda: all(registered(s) or not self.liveness.alive(s) for s in numbers), seconds)
            self.store.set(keys.members(1), json.dumps([s for s in numbers if registered(s)]))
            self.store.set(keys.requests(1), "0")
            self.store.set(keys.CURRENT_ROUND, "1")
        return self._enter(1, self._wait_for(keys.members(1), seconds + SETTLE_S + self.timeouts.heartbeat))

    def _registered(self, number: int, member: int) -> bool:
        return self.store.check([keys.registered(number, member)])

    def _arrived(self) -> int:
        return int(self.store.add(keys.SEQUENCE, 0))

    def _enter(self, number: int, members: list[int]) -> Round:
        if self.me not in members:
            raise GradsyncError(f"worker {self.me} was left out of round {number} (declared dead); exiting")
        self.round = Round(number, members, self.me)
        self.liveness.watch_only(members)
        self.store.set(keys.joined(self.me), "1")
        self._admission = (self.round, Admission(int(self.store.get(keys.requests(number)))))
        return self.round

    def request_to_join(self) -> None:
        self.joined_late = True
        self.store.delete_key(keys.joined(self.me))  # a member left out of a round joins again
        self.store.delete_key(keys.lost(self.me))  # it was declared lost, and is back
        self.store.set(keys.joiner(self.me), "1")
        self.store.add(keys.JOIN_REQUESTS, 1)

    def pending_joiners(self) -> list[int]:
        count = self._arrived()
        check = self.store.check
        return [s for s in range(1, count + 1) if check([keys.joiner(s)]) and not check([keys.joined(s)])]

    # --------------------------------------------------------------------------------------------- rounds
    def next_round(self, steps: int = 0) -> Round:
        """Agree on the next round's members: the current members still alive and the workers waiting to join.
        Every live member calls this with the steps it committed; a worker joining calls it after
        :meth:`request_to_join`."""
        if self.round is None:
            return self._join_a_round()
        # A round whose leader died before naming the members is skipped: everyone tries the next number.
        number = max(self.round.number, self._tried) + 1
        self._tried = number
        self.store.set(keys.registered(number, self.me), str(steps))
        if self.store.compare_set(keys.leader(number), "", str(self.me)).decode() == str(self.me):
            self._decide(number)
        members = self._wait_for(keys.members(number), 2 * (SETTLE_S + self.timeouts.collective))
        if self.me not in members:  # declared dead (cut off, or stopped for too long): join again, in-process
            log.warning("gradsync elastic: worker %d was left out of round %d; asking to join again", self.me, number)
            self.request_to_join()
            self.round = None
            return self._join_a_round()
        return self._enter(number, members)

    def _join_a_round(self) -> Round:
        """A joiner registers for the round after the latest formed, and tries the next one if that round formed
        without it (it registered too late); the members admit it at a step boundary."""
        seconds = self.timeouts.admission
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.job_done():
                raise JobFinished("the job finished before this worker could join")
            number = self._current_round() + 1
            self.store.set(keys.registered(number, self.me), "0")
            members = self._wait_for(keys.members(number), max(1.0, deadline - time.monotonic()), give_up=keys.DONE)
            if self.me in members:
                return self._enter(number, members)
            self.store.delete_key(keys.joined(self.me))  # marked expired by that round: still joining
        raise GradsyncError(
            f"worker {self.me} was not admitted within {seconds:.0f}s (GRADSYNC_ELASTIC_ADMISSION_TIMEOUT): the "
            "members reached no step boundary meanwhile, or kept forming rounds without it"
        )

    def _decide(self, number: int) -> None:
        requests = int(self.store.add(keys.JOIN_REQUESTS, 0))  # before the joiners are listed: none is missed
        current = self.round.members if self.round is not None else []
        joiners = self.pending_joiners()
        # Members keep their order and joiners come last, so rank 0 (whose state everyone receives) is a member that
        # lived through the change: a worker that was cut off and asks to join again keeps its old, low number.
        wanted = current + sorted(set(joiners) - set(current))
        registered = lambda m: self._registered(number, m)  # noqa: E731
        # Known gone: its launcher saw it exit, or the member watching it saw its heartbeat stop.
        gone = {m for m in wanted if self.store.check([keys.exited(m)]) or self.store.check([keys.lost(m)])}
        alive = lambda m: m not in gone and self.liveness.alive(m)  # noqa: E731
        # A live member may be inside a collective that fails only at the group's timeout: wait for it that long.
        # Not for one whose heartbeat stood still for SUSPECT_S while the others registered: a round is being
        # decided because something failed, and a live member's heartbeat thread beats even inside a collective.
        # So a host lost whole (no launcher left to report the exit) costs a second, not the heartbeat timeout. A
        # live member wrongly left out joins again in-process.
        awaited = lambda m: alive(m) and self.liveness.still_for(m) < SUSPECT_S  # noqa: E731
        live_registered = lambda: all(registered(m) for m in wanted if awaited(m))  # noqa: E731
        wait_until(live_registered, SETTLE_S + self.timeouts.collective, pause=0.005, max_pause=0.02)
        # Registered and still alive: a worker killed after registering (its launcher reported it) is left out.
        members = [m for m in wanted if registered(m) and alive(m)]
        for vanished in set(joiners) - set(members):  # asked to join, then vanished: stop waiting for it
            self.store.set(keys.joined(vanished), "expired")
        self.store.set(keys.members(number), json.dumps(self._most_committed_first(number, members, current)))
        self.store.set(keys.requests(number), str(requests))
        self.store.set(keys.CURRENT_ROUND, str(number))

    def _most_committed_first(self, number: int, members: list[int], current: list[int]) -> list[int]:
        """``members`` with rank 0 a member that committed the most steps. A step commits on each member when its
        all-reduce completes there; a member lost inside that all-reduce can leave some members with the step
        committed and some without. Every member takes rank 0's state, so with this rank 0 a step committed
        anywhere is committed everywhere (its gradients were every member's: the all-reduce completed somewhere)."""
        steps = {m: int(self.store.get(keys.registered(number, m))) for m in members if m in current}
        if not steps:
            return members
        most = max(steps.values())
        first = next(m for m in members if steps.get(m) == most)
        return [first] + [m for m in members if m != first]

    def _current_round(self) -> int:
        return int(self.store.get(keys.CURRENT_ROUND)) if self.job_running() else 0

    def _wait_for(self, key: str, seconds: float, give_up: str | None = None) -> list[int]:
        def listed() -> bool:
            if give_up and self.store.check([give_up]):  # e.g. "done": the members finished
                raise JobFinished("the job finished before this worker could join")
            return self.store.check([key])

        if not wait_until(listed, seconds, max_pause=0.02):
            raise MembershipChanged(f"no member list at {key} within {seconds:.0f}s: the round's leader died")
        return json.loads(self.store.get(key))

    def form_group(self, round_: Round) -> None:
        """A fresh default process group for ``round_`` (the previous one, if any, is destroyed first)."""
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # a group with dead members may not close cleanly; it is dropped either way
                pass
        prefix = dist.PrefixStore(keys.group_prefix(round_.number), self.store)
        try:
            dist.init_process_group(
                "gloo",
                store=prefix,
                rank=round_.rank,
                world_size=round_.world_size,
                timeout=datetime.timedelta(seconds=self.timeouts.collective),  # a stopped member is found within
            )
        except dist.DistError as exc:  # a member died while the group formed: the next round goes without it
            # The default group's store keys carry a per-process counter of groups made, which
            # destroy_process_group resets to 0 "to allow consistent value ... after some trainers recover from
            # failure" (torch/distributed/distributed_c10d.py). A failed init bumps it with no group to destroy:
            # reset it too, or this worker's keys never match the others' again.
            torch_private.reset_group_count()
            raise MembershipChanged(f"forming round {round_.number}'s group failed: {exc}") from exc
        self._group_store = (round_, torch_private.default_store())

    def _tell_members(self, member: int, why: str) -> None:
        """From the heartbeat thread: a member of this round is gone. Post it as that rank's report in the round's
        group, where a member whose collective just failed waits a moment for the peers' reports: a dead rank never
        posts one, and the survivors would wait for it (2 s) on every SIGKILL."""
        known = self._group_store
        if known is None or member not in known[0].members:
            return
        round_, store = known
        rank = round_.members.index(member)
        post_gone(store, rank, f"worker {member} (rank {rank} of round {round_.number}) {why}")
        self.store.set(keys.lost(member), why)  # for the leader of the next round

    # ------------------------------------------------------------------------------------ step boundaries
    def step_boundary(self, step: int) -> bool:
        """Called by every member after it committed ``step`` (its optimizer stepped): whether this boundary admits
        the workers waiting to join (the members then form the next round). No store operation: the heartbeat
        thread reads the round's admission key on its own connection (:meth:`_look_for_admission`), and rank 0's
        announces a step far enough ahead that every member has read it by then. A member that still misses it
        fails its next collective (the others left the group) and joins the next round with them: late, never
        wrong."""
        lost = self.liveness.health.lost
        if lost is not None:
            raise GradsyncError(
                f"worker {self.me} (rank {self.round.rank if self.round else '?'}): {job_store.describe(self.where)} "
                f"is lost: {lost}. Without it the members cannot agree on any change, so training stops here; "
                "restart the job from its last checkpoint once the store is back."
            )
        current = self._admission
        assert current is not None
        admission = current[1]
        admission.tick(time.monotonic(), step)
        return admission.at is not None and step >= admission.at

    def _look_for_admission(self, store: dist.Store) -> None:
        """From the heartbeat thread, each beat: rank 0 announces the admitting step when a worker asked to join;
        every member reads the announcement."""
        current = self._admission
        if current is None or current[1].at is not None:
            return
        round_, admission = current
        key = keys.admit_at(round_.number)
        ahead = admission.steps_ahead()
        if round_.rank == 0 and ahead is not None and int(store.add(keys.JOIN_REQUESTS, 0)) > admission.requests:
            store.compare_set(key, "", str(admission.step + ahead))
        if store.check([key]):
            admission.announced(int(store.get(key)))


@dataclass(frozen=True)
class Timeouts:
    """elastic's three waits, each with its own meaning (seconds):

    - ``heartbeat``: a member whose heartbeat has not moved for this long counts as lost;
    - ``collective``: the round's process group's timeout: a collective with a stopped member fails after it;
    - ``admission``: how long a worker asking to join waits to be admitted.

    Each has a ``GRADSYNC_ELASTIC_*_TIMEOUT`` override (HEARTBEAT, COLLECTIVE, ADMISSION).

    Example::

        timeouts = Timeouts(heartbeat=10, collective=30, admission=600)   # gradsync.elastic.init(10, 30, 600)'s
    """

    heartbeat: float = 10.0
    collective: float = 10.0
    admission: float = 600.0

    @classmethod
    def read(cls, heartbeat: float, collective: float | None, admission: float) -> Timeouts:
        heartbeat = settings.read_seconds("GRADSYNC_ELASTIC_HEARTBEAT_TIMEOUT", heartbeat)
        collective = settings.read_seconds("GRADSYNC_ELASTIC_COLLECTIVE_TIMEOUT", collective or heartbeat)
        admission = settings.read_seconds("GRADSYNC_ELASTIC_ADMISSION_TIMEOUT", admission)
        return cls(heartbeat, collective, admission)


def report_exit(store: dist.Store, worker: str) -> None:
    """Called by a launcher when its worker ``worker`` (its WORKER_VARIABLE) exited: the members stop waiting for it."""
    key = keys.worker(worker)
    if store.check([key]):
        mark_exited(store, int(store.get(key)))


def job_done(store: dist.Store) -> bool:
    """Whether the members finished training (a launcher then restarts no worker)."""
    return store.check([keys.DONE])


def everyone_finished(store: dist.Store) -> bool:
    """Whether every member of the latest round reported its training finished (the store's host may close)."""
    if not store.check([keys.CURRENT_ROUND]):
        return False
    members = json.loads(store.get(keys.members(int(store.get(keys.CURRENT_ROUND)))))
    return int(store.add(keys.FINISHED, 0)) >= len(members)
