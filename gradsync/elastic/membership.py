"""Who is in the job, as one worker sees it: its number, the round it is in, and the admission of joiners.

All coordination goes through the job's key-value store (a TCPStore the elastic launcher hosts, outside every
worker, so a dead worker takes no state with it; or an etcd cluster, so a dead host takes none either:
:mod:`gradsync.store.job_store`; its keys: :mod:`gradsync.elastic.keys`). :class:`Membership` is the worker's
side, built from collaborators it calls: who is alive is :mod:`gradsync.elastic.liveness`'s question (heartbeats,
and exits reported by launchers), how a round's members are agreed on is :mod:`gradsync.elastic.rounds`', and the
round's process group is :mod:`gradsync.elastic.round_group`'s.

Between rounds the store is not touched per step (:meth:`Membership.step_boundary`): a step is committed when its
gradients' all-reduce completed, which every member's backward took part in, and a worker asking to join is
admitted at a step boundary rank 0 announces a few steps ahead (:class:`~gradsync.elastic.training_view.Admission`).
"""

from __future__ import annotations

import contextlib
import os

import torch.distributed as dist

from gradsync.collectives.activity import CollectiveActivity, of_this_process
from gradsync.elastic import keys, verdicts
from gradsync.elastic.errors import JobFinished
from gradsync.elastic.job_status import MAX_WORLD_VARIABLE, WORKER_VARIABLE, job_done, job_running
from gradsync.elastic.liveness import Liveness
from gradsync.elastic.pace import Pace
from gradsync.elastic.round_group import RoundGroup
from gradsync.elastic.rounds import Rounds
from gradsync.elastic.timeouts import Timeouts
from gradsync.elastic.training_view import Round, TrainingView
from gradsync.elastic.verdicts import Stall, Suspicions
from gradsync.errors import GradsyncError
from gradsync.log import log
from gradsync.runtime.env import ELASTIC_STORE_VARIABLE
from gradsync.store import job_store


class Membership:
    """This worker's view of the job; ``connect()`` from the environment ``gradsync run --elastic`` sets.

    Example::

        job = gradsync.elastic.init(timeout=10)   # this worker's Membership
        if not job.finished_without_me:           # True for one cut off that came back after the others finished
            print(f"a member lost for {job.timeout} s is left out")
        job.finished()
    """

    def __init__(
        self,
        store: dist.Store,
        beat_store: dist.Store,
        timeouts: Timeouts,
        where: str = "",
        activity: CollectiveActivity | None = None,
    ) -> None:
        self.store = store
        self.where = where  # how the store was reached, for messages
        self.timeouts = timeouts
        self.me = store.add(keys.SEQUENCE, 1)
        if os.environ.get(WORKER_VARIABLE):
            store.set(keys.worker(os.environ[WORKER_VARIABLE]), str(self.me))
        self.joined_late = False  # admitted into a running job: it receives the members' state first
        # What the training thread is in (its round, the group it forms, the leader it waits on, the admission), the
        # one thing the heartbeat thread reads of it.
        self._view = TrainingView()
        self._group = RoundGroup(store, timeouts, alarm_store=beat_store, view=self._view)
        self._finished_without_me = False
        self._beat_store = beat_store
        # The training thread's collectives (None: not watched): a step stalled outside them is posted.
        self._activity = activity
        self._stall = Stall(self.me, activity, timeouts.collective) if activity is not None else None
        self._pace = Pace(self.me, activity) if activity is not None else None  # a straggler, reported
        self.liveness = Liveness(
            beat_store, self.me, timeouts.heartbeat, on_gone=self._member_gone, on_beat=self._each_beat
        )
        self._rounds = Rounds(store, self.me, self.liveness, timeouts, self._view)
        self._suspicions = Suspicions(self.liveness)

    def _member_gone(self, member: int, why: str) -> None:
        """From the heartbeat thread, on its own connection: a watched member is gone. The round it was deciding
        is abandoned, the round being formed with it called off, and the current round's members told."""
        self._rounds.abandon(self._beat_store, member, why)
        self._group.tell_members(member, why, self.liveness.last_count(member))

    def coordinating(self) -> contextlib.AbstractContextManager:
        """The training thread is in the job's own coordination (joining, forming a round, receiving the state):
        however long that takes, it is not a step stalled outside every collective (:class:`~.verdicts.Stall`)."""
        return self._activity.inside() if self._activity is not None else contextlib.nullcontext()

    def finished_while_stalled(self) -> JobFinished | None:
        """The job finished while this worker's training thread was stalled in a step (its heartbeat thread saw
        it): the error to end this worker with, status 0; else None."""
        if self._stall is None or not self._stall.job_finished.is_set():
            return None
        return JobFinished(
            f"worker {self.me}: the job finished while this worker's training thread was stalled outside every "
            f"collective for over {self.timeouts.collective:g}s (GRADSYNC_ELASTIC_COLLECTIVE_TIMEOUT), and the others "
            "went on without it"
        )

    @property
    def round(self) -> Round | None:
        """The round this worker is in (None before its first, and while it joins again)."""
        return self._view.seen().round

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
        where = os.environ.get(ELASTIC_STORE_VARIABLE)
        if not where:
            raise GradsyncError(
                f"elastic training needs the job's store: start the job with `gradsync run --elastic ...` (it sets "
                f"{ELASTIC_STORE_VARIABLE})."
            )
        # Two clients: the heartbeat thread never shares a connection with the training thread.
        store, beat_store = job_store.open_stores(where, 2)
        return cls(store, beat_store, timeouts, where, of_this_process())

    def stop(self) -> None:
        self.liveness.stop()

    def finished(self) -> None:
        """This worker's training function returned: the store host may close once every member has."""
        self.store.set(keys.DONE, "1")  # a worker still waiting to join need not
        self.store.add(keys.FINISHED, 1)
        self.stop()

    def job_done(self) -> bool:
        return job_done(self.store)

    @staticmethod
    def max_world_size() -> int | None:
        """The most workers the job may have at once (``--nnodes``' maximum x ``--nproc-per-node``, from the
        launcher); None where it did not say."""
        value = os.environ.get(MAX_WORLD_VARIABLE, "")
        return int(value) if value.isdigit() else None

    # ------------------------------------------------------------------------------------------- joining
    def job_running(self) -> bool:
        return job_running(self.store)

    def first_round(self, expected: int, seconds: float = 300.0) -> Round:
        """The job's first round: the first worker to arrive waits for ``expected`` in all (at most ``seconds``).
        A worker that took a number and died before registering (its heartbeat never moves) is left out."""
        return self._enter(1, self._rounds.first(expected, seconds))

    def _enter(self, number: int, members: list[int]) -> Round:
        if self.me not in members:
            raise GradsyncError(f"worker {self.me} was left out of round {number} (declared dead); exiting")
        round_ = Round(number, members, self.me)
        self.liveness.watch_only(members)
        self.store.set(keys.joined(self.me), "1")
        self._view.entered(round_, int(self.store.get(keys.requests(number))), beat_s=self.liveness.interval)
        return round_

    def request_to_join(self) -> None:
        self.joined_late = True
        self.store.delete_key(keys.joined(self.me))  # a member left out of a round joins again
        self.store.delete_key(keys.lost(self.me))  # it was declared lost, and is back
        verdicts.ask_to_join(self.store, self.me)

    # --------------------------------------------------------------------------------------------- rounds
    def next_round(self, steps: int = 0) -> Round:
        """Agree on the next round's members: the current members still alive and the workers waiting to join.
        Every live member calls this with the steps it committed; a worker joining calls it after
        :meth:`request_to_join`."""
        if self.round is None:
            return self._join_a_round()
        number, members = self._rounds.agree(self.round, steps)
        if self.me not in members:  # declared dead (cut off, or stopped for too long): join again, in-process
            log.warning("gradsync elastic: worker %d was left out of round %d; asking to join again", self.me, number)
            self.request_to_join()
            self._view.left_out()
            return self._join_a_round()
        return self._enter(number, members)

    def _join_a_round(self) -> Round:
        """A joiner enters the first round that lists it (:meth:`Rounds.join`)."""
        return self._enter(*self._rounds.join())

    def leave_group(self, failure: BaseException | None = None) -> None:
        """Close the current round's group now (:meth:`RoundGroup.leave`), after ``failure``, the error that ended
        it, let go of it: the members still inside its failed collective fail at once instead of at the group's
        timeout."""
        self._group.leave(failure)

    def form_group(self, round_: Round) -> None:
        """A fresh default process group for ``round_`` (the previous one, if any, is destroyed first)."""
        self._group.form(round_)

    # ------------------------------------------------------------------------------------ step boundaries
    def step_boundary(self, step: int) -> bool:
        """Called by every member after it committed ``step`` (its optimizer stepped): whether this boundary admits
        the workers waiting to join (the members then form the next round). No store operation: the heartbeat
        thread reads the round's admission key on its own connection (:meth:`_look_for_admission`), and rank 0's
        announces a step far enough ahead that every member has read it by then. A member that still misses it
        fails its next collective (the others left the group) and joins the next round with them: late, never
        wrong."""
        if (finished := self.finished_while_stalled()) is not None:
            raise finished  # before the store's loss: a TCPStore closes with the job
        lost = self.liveness.health.lost
        if lost is not None:
            raise GradsyncError(
                f"worker {self.me} (rank {self.round.rank if self.round else '?'}): {job_store.describe(self.where)} "
                f"is lost: {lost}. Without it the members cannot agree on any change, so training stops here; "
                "restart the job from its last checkpoint once the store is back."
            )
        at = self._view.committed(step)
        return at is not None and step >= at

    def _each_beat(self, store: dist.Store) -> None:
        """From the heartbeat thread, each beat: a round being formed with a member that looks dead is called off,
        a round whose leader looks dead is abandoned, a member of this round that looks dead is posted for the next
        round's leader (:class:`~.verdicts.Suspicions`), the admission announcement is looked for, and this worker's
        own training thread, stalled in a step, is posted (:class:`~.verdicts.Stall`), as its pace is
        (:class:`~.pace.Pace`: rank 0 says which member the others wait on)."""
        self._group.call_off_for_suspects(self.liveness.suspects)
        self._rounds.abandon_if_leader_suspected(store)
        current = self._view.seen().round
        if current is not None:
            self._suspicions.post_new(store, current.number, current.members)
        self._look_for_admission(store)
        if self._pace is not None:
            self._pace.look(store, current)
        if self._stall is not None:
            self._stall.look(store)
            if self._stall.job_finished.is_set():
                self.liveness.stop()  # no member watches it now, and the store may close with the job

    def _look_for_admission(self, store: dist.Store) -> None:
        """From the heartbeat thread, each beat: rank 0 announces the admitting step when a worker asked to join;
        every member reads the announcement."""
        seen = self._view.seen()
        round_, admission = seen.round, seen.admission
        if round_ is None or admission is None or admission.at is not None:
            return
        key = keys.admit_at(round_.number)
        ahead = admission.steps_ahead()
        if round_.rank == 0 and ahead is not None and int(store.add(keys.JOIN_REQUESTS, 0)) > admission.requests:
            store.compare_set(key, "", str(admission.step + ahead))
        if store.check([key]):
            self._view.announce(round_.number, int(store.get(key)))
