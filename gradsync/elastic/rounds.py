"""Rounds: how the members of each round are agreed on through the job's store.

Each worker gets a sequence number when it first arrives; the members of a round, in sequence order, are its
ranks, so survivors keep their relative order and newcomers come last. A round: every live worker registers (with
the steps it committed); the first to claim the round's leadership (``compare_set``) waits until every live member
registered (a live one may first have to time out of a collective), then writes the round's member list, the
member with the most committed steps first; everyone reads it. A round whose leader dies before naming the members
is abandoned as soon as a member waiting for it sees the leader gone (its launcher's exit report, or its heartbeat):
that member writes the abandonment where the list would be, and everyone tries the next number. A joiner registers
for the round after the latest formed, and follows the members to the next number whenever they move past its round
without naming it.
"""

from __future__ import annotations

import datetime
import json
import time

import torch.distributed as dist

from gradsync.elastic import keys, verdicts
from gradsync.elastic.errors import JobFinished, JobStateLost, MembershipChanged
from gradsync.elastic.job_status import find_state_lost, job_running
from gradsync.elastic.liveness import SUSPECT_BEATS, Liveness
from gradsync.elastic.silent_holders import SilentHolders
from gradsync.elastic.timeouts import Timeouts
from gradsync.elastic.training_view import Round, TrainingView
from gradsync.elastic.verdicts import Verdicts
from gradsync.errors import GradsyncError
from gradsync.log import log
from gradsync.polling import wait_until

SETTLE_S = 1.0
ABANDONED = "abandoned"  # the key of a member list's JSON object when the round's leader died deciding it
EXPIRED = "expired"  # joined/<member>'s value (with why) when a round went without that joiner
STATE_LOOK_S = 1.0  # a joiner looks this often whether the job's state is still held by a member


class Rounds:
    """The agreement on each round's members, for worker ``me``; each method returns a round's number and members
    (the caller enters the round)."""

    def __init__(
        self, store: dist.Store, me: int, liveness: Liveness, timeouts: Timeouts, view: TrainingView | None = None
    ) -> None:
        self._store = store
        self._me = me
        self._liveness = liveness
        self._timeouts = timeouts
        self._tried = 0  # the last round number this worker registered for
        self._view = view if view is not None else TrainingView()  # the leader waited on, for the beat thread
        self._silent = SilentHolders(store, liveness, me)  # a joiner's word on state holders gone silent

    def first(self, expected: int, seconds: float) -> list[int]:
        """Round 1's members: the first worker to arrive waits for ``expected`` in all (at most ``seconds``). A
        worker that took a number and died before registering (its heartbeat never moves) is left out."""
        self._store.set(keys.registered(1, self._me), "0")
        if self._me == 1:
            wait_until(lambda: self._arrived() >= expected, seconds)
            numbers = range(1, self._arrived() + 1)
            registered = lambda s: self._registered(1, s)  # noqa: E731
            wait_until(lambda: all(registered(s) or not self._liveness.alive(s) for s in numbers), seconds)
            self._store.set(keys.members(1), json.dumps([s for s in numbers if registered(s)]))
            self._store.set(keys.committed(1), "0")
            self._store.set(keys.requests(1), "0")
            self._store.set(keys.verdicts_counted(1), "0")
            self._store.set(keys.CURRENT_ROUND, "1")
        return self._wait_for(keys.members(1), seconds + SETTLE_S + self._timeouts.heartbeat)

    def agree(self, current: Round, steps: int) -> tuple[int, list[int]]:
        """The round after ``current``: this member registers with the ``steps`` it committed, decides the members
        if it is the first to claim the round, and reads them (which may leave it out)."""
        # A round whose leader died before naming the members is skipped: everyone tries the next number.
        latest = self._current_round()
        if latest > current.number:
            # A round formed without this member (it was cut off, and the others went on): it must not lead one
            # from its stale view (it would list its old round's members and put its own, older, state first).
            # It reads the latest round, which leaves it out, and joins again (Membership.next_round).
            self._tried = max(self._tried, latest)
            return latest, self._read_members(latest) or []
        number = max(current.number, self._tried) + 1
        self._tried = number
        self._store.set(keys.registered(number, self._me), str(steps))
        leader = int(self._store.compare_set(keys.leader(number), "", str(self._me)).decode())
        if leader == self._me:
            self._decide(number, current)
            return number, self._wait_for(keys.members(number), SETTLE_S)  # its list, or a member's abandonment
        with self._view.waiting_for(number, leader):
            # Watched from now (the heartbeat thread calls abandon() if it goes), and judged at once: its exit may
            # have been seen already, before this member knew it would lead.
            if not self._liveness.alive(leader):
                self.abandon(self._store, leader, self._liveness.why_dead(leader))
            return number, self._wait_for(keys.members(number), 2 * (SETTLE_S + self._timeouts.collective))

    def abandon(self, store: dist.Store, member: int, why: str) -> None:
        """``member`` is gone (``why``): if it leads the round this member waits on, write that round's abandonment
        where its member list would be, so that every member waiting tries the next number now instead of after
        ``2 * (SETTLE_S + collective timeout)``. From the heartbeat thread, on its own ``store`` connection (the
        training thread's waits on the list). A leader that was only slow loses the list's ``compare_set`` and
        tries the next number too."""
        awaited = self._view.seen().leader
        if awaited is None or awaited[1] != member:
            return
        abandonment = {ABANDONED: f"its leader, worker {member}, {why}"}
        store.compare_set(keys.members(awaited[0]), "", json.dumps(abandonment))

    def abandon_if_leader_suspected(self, store: dist.Store) -> None:
        """From the heartbeat thread, each beat: the leader this member waits on, if its heartbeat stood still for
        ``SUSPECT_BEATS`` beats, has its round abandoned now (:meth:`abandon`), not at the heartbeat timeout: a
        leader lost with its host (no launcher left to report the exit) would keep its members waiting that whole
        timeout. A live leader wrongly suspected loses the list's ``compare_set`` and tries the next number with the
        others: one more round, never a wrong one."""
        awaited = self._view.seen().leader
        if awaited is None:
            return
        leader = awaited[1]
        still = self._liveness.suspects([leader]).get(leader)
        if still is not None:
            self.abandon(store, leader, f"whose heartbeat stood still for {still:.1f}s as it decided")

    def join(self) -> tuple[int, list[int]]:
        """A joiner registers for the round after the latest formed, and follows the members to the next number
        when they move past that round without naming it (its leader died); the members admit it at a step
        boundary. A round that formed without it (it registered too late) counted its request: it asks again."""
        deadline = time.monotonic() + self._timeouts.admission
        number = self._current_round() + 1
        while time.monotonic() < deadline:
            self._store.set(keys.registered(number, self._me), "0")
            members = self._listing(number, deadline)
            if members is None:  # the members moved past this round: register for the next one too
                number += 1
                continue
            if self._me in members:
                return number, members
            self._say_why_left_out(number)
            self._store.delete_key(keys.joined(self._me))  # marked expired by that round: still joining
            verdicts.ask_to_join(self._store, self._me)  # for the next round's leader and its rank 0's announcement
            number = max(number, self._current_round()) + 1
        raise self._not_admitted()

    def _say_why_left_out(self, number: int) -> None:
        if self._store.check([keys.joined(self._me)]):
            said = self._store.get(keys.joined(self._me)).decode().removeprefix(f"{EXPIRED}: ")
            log.warning("gradsync elastic: worker %d is not in round %d: %s; asking again", self._me, number, said)

    def _not_admitted(self) -> GradsyncError:
        silent = self._silent.why()
        why = (
            f"{silent}. If none can come back, the job's state is lost: restart the job from its last checkpoint"
            if silent
            else "the members reached no step boundary meanwhile, or kept forming rounds without it"
        )
        return GradsyncError(
            f"worker {self._me} was not admitted within {self._timeouts.admission:.0f}s "
            f"(GRADSYNC_ELASTIC_ADMISSION_TIMEOUT): {why}"
        )

    def _listing(self, number: int, deadline: float) -> list[int] | None:
        """Round ``number``'s members once listed; None once it was abandoned, or the next round was claimed while
        it was not listed (its leader died, and the members gave up on it). Polled: a joiner waits on three
        questions (and on a job that finishes meanwhile: :class:`JobFinished`)."""
        found: list[list[int] | None] = []
        looked = [time.monotonic()]

        def answered() -> bool:
            if self._store.check([keys.DONE]):
                raise JobFinished("the job finished before this worker could join")
            if time.monotonic() - looked[0] > STATE_LOOK_S:  # else a job that lost its state waits forever
                looked[0] = time.monotonic()
                if (why := find_state_lost(self._store)) is not None:
                    raise JobStateLost(f"worker {self._me} cannot join: {why}")
                self._silent.look(self._timeouts.admission)
            if self._store.check([keys.members(number)]):
                found.append(self._read_members(number))
            elif self._store.check([keys.leader(number + 1)]):
                found.append(None)
            return bool(found)

        if not wait_until(answered, max(0.0, deadline - time.monotonic()), max_pause=0.02):
            raise self._not_admitted()
        return found[0]

    def _decide(self, number: int, current: Round) -> None:
        requests = int(self._store.add(keys.JOIN_REQUESTS, 0))  # before the joiners are listed: none is missed
        joiners = verdicts.joiners_pending(self._store, since=self._kept(keys.requests(current.number)))
        floor = self._kept(keys.committed(current.number)) or 0
        # Members keep their order and joiners come last, so rank 0 (whose state everyone receives) is a member that
        # lived through the change: a worker that was cut off and asks to join again keeps its old, low number.
        wanted = current.members + sorted(set(joiners) - set(current.members))
        registered = lambda m: self._registered(number, m)  # noqa: E731
        # Exits reported; members declared lost or suspected by their watchers, since the current round formed.
        known = Verdicts(self._store, wanted, since=self._kept(keys.verdicts_counted(current.number)))
        # Two requests a look, whatever the members (a TCPStore checks a list of keys at once), not one a member.
        live = lambda: [m for m in wanted if self._waits_for(m, known)]  # noqa: E731
        live_registered = lambda: known.look() and self._all_registered(number, live())  # noqa: E731
        wait_until(live_registered, SETTLE_S + self._timeouts.collective, pause=0.005, max_pause=0.02)
        # Registered and still alive: a worker killed after registering (its launcher reported it) is left out.
        everyone = self._all_registered(number, wanted)
        members = [m for m in wanted if (everyone or registered(m)) and self._alive(m, known)]
        for vanished in set(joiners) - set(members):  # asked to join, then vanished: stop waiting for it
            why = self._left_out_because(number, vanished, known)
            self._store.set(keys.joined(vanished), f"{EXPIRED}: {why}")
        ordered, most = self._most_committed_first(number, members, current.members)
        if most < floor:  # every member holding the job's state is missing: never go back to an older one
            self._abandon_for_an_older_state(number, floor, most)
            return
        listed = json.dumps(ordered)
        if self._store.compare_set(keys.members(number), "", listed).decode() != listed:
            return  # a member saw this leader gone and abandoned the round meanwhile: agree() reads that
        self._store.set(keys.committed(number), str(most))
        self._store.set(keys.requests(number), str(requests))
        self._store.set(keys.verdicts_counted(number), str(known.count))
        self._store.set(keys.CURRENT_ROUND, str(number))
        self._say_who_stalled(number, [m for m in current.members if m not in members], known)

    def _say_who_stalled(self, number: int, left_out: list[int], known: Verdicts) -> None:
        """Said by the leader, once: a member left out because its own step stalled is the user's code to look at."""
        for member in left_out:
            if member in known.stalled:
                why = known.stalled[member]
                log.warning(
                    "gradsync elastic: round %d goes on without worker %d: %s (a step stuck in user code, a data "
                    "loader or a file system?); it joins again when it wakes",
                    number,
                    member,
                    why,
                )

    def _alive(self, member: int, known: Verdicts) -> bool:
        """Not known gone, and its heartbeat moved within the timeout as this leader saw it. The leader is alive,
        whatever a watcher wrote: a round listed without it could hold no member with the job's state (every other
        one lost too), and would start from a joiner's."""
        return member == self._me or (member not in known.gone and self._liveness.alive(member))

    def _waits_for(self, member: int, known: Verdicts) -> bool:
        """Whether the leader waits for ``member`` to register. A live member may be inside a collective that fails
        only at the group's timeout: it is waited for that long. Not one whose heartbeat stood still for
        ``SUSPECT_BEATS`` beats, seen by its watcher (which watched it all along: verdicts.py) or by this leader: a
        round is being decided because something failed, and a live member's heartbeat thread beats even inside a
        collective. So a host lost whole (no launcher left to report the exit) costs ``SUSPECT_BEATS`` beats of
        the round's interval (longer past 100 members: :func:`~.liveness.beat_interval`), not the heartbeat
        timeout. Nor one that said its training thread is stalled, outside every collective past the collective
        timeout (:class:`~.verdicts.Stall`): no collective of it is left to fail. A live member wrongly left out
        joins again in-process."""
        suspect_s = SUSPECT_BEATS * self._liveness.interval
        return (
            self._alive(member, known)
            and member not in known.stalled
            and not known.suspected(member, self._liveness.last_count(member))
            and self._liveness.still_for(member) < suspect_s
        )

    def _abandon_for_an_older_state(self, number: int, floor: int, most: int) -> None:
        why = f"no member that committed step {floor} or later registered (the best had {most})"
        self._store.compare_set(keys.members(number), "", json.dumps({ABANDONED: why}))
        if (lost := find_state_lost(self._store)) is not None:  # and none of them will come back
            raise JobStateLost(f"worker {self._me} (at step {most}) cannot go on: {lost}")

    def _left_out_because(self, number: int, member: int, known: Verdicts) -> str:
        """Why round ``number`` goes without the joiner ``member``, for it to say (a joiner left out round after
        round is otherwise a silent livelock)."""
        if member in known.gone:
            return "its exit was reported, or its watcher declared it lost"
        if not self._registered(number, member):
            seen = self._liveness.last_count(member)
            suspected = ", and its watcher saw its heartbeat stand still" if known.suspected(member, seen) else ""
            return f"it had not registered for round {number} when worker {self._me} decided it{suspected}"
        still = self._liveness.still_for(member)
        return f"its heartbeat stood still for {still:.1f}s as worker {self._me}, deciding round {number}, saw it"

    def _most_committed_first(self, number: int, members: list[int], current: list[int]) -> tuple[list[int], int]:
        """``members`` with rank 0 a member that committed the most steps, and those steps (-1: none of the current
        round's members is in it). A step commits on each member when its all-reduce completes there; a member
        lost inside that all-reduce can leave some members with the step committed and some without. Every member
        takes rank 0's state, so with this rank 0 a step committed anywhere is committed everywhere (its gradients
        were every member's: the all-reduce completed somewhere)."""
        steps = {m: int(self._store.get(keys.registered(number, m))) for m in members if m in current}
        if not steps:
            return members, -1
        most = max(steps.values())
        first = next(m for m in members if steps.get(m) == most)
        return [first] + [m for m in members if m != first], most

    def _kept(self, key: str) -> int | None:
        """A count a round's leader kept as it decided: its join requests and verdicts counted (each member read
        them on entering it), the steps it started from (no later round may start from fewer). None where it is not
        written (a round made by hand in a test, or formed before the key was kept)."""
        return int(self._store.get(key)) if self._store.check([key]) else None

    def _registered(self, number: int, member: int) -> bool:
        return self._store.check([keys.registered(number, member)])

    def _all_registered(self, number: int, members: list[int]) -> bool:
        return not members or self._store.check([keys.registered(number, m) for m in members])

    def _arrived(self) -> int:
        return int(self._store.add(keys.SEQUENCE, 0))

    def _current_round(self) -> int:
        return int(self._store.get(keys.CURRENT_ROUND)) if job_running(self._store) else 0

    def _wait_for(self, key: str, seconds: float) -> list[int]:
        """The member list at ``key``, once the round's leader wrote it (or its abandonment: raises)."""
        if not self._set_within(key, seconds):
            raise MembershipChanged(f"no member list at {key} within {seconds:.0f}s: the round's leader died")
        listed = json.loads(self._store.get(key))
        if isinstance(listed, dict):
            raise MembershipChanged(f"{key}: the round was abandoned: {listed[ABANDONED]}")
        return listed

    def _read_members(self, number: int) -> list[int] | None:
        listed = json.loads(self._store.get(keys.members(number)))
        return None if isinstance(listed, dict) else listed

    def _set_within(self, key: str, seconds: float) -> bool:
        """The store waits: a TCPStore answers once the key is set, with no request meanwhile (etcd: a watch).
        Polling would put a request from every waiting member on the store at each poll, while the leader decides,
        and slow its deciding (docs/scaling.md, "Waiting members polled")."""
        try:
            self._store.wait([key], datetime.timedelta(seconds=seconds))
        except dist.DistStoreError:  # its timeout
            return False
        return True
