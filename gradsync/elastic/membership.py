"""Who is in the job: the members of each round, and the process group formed for a round.

All coordination goes through the job's key-value store (a TCPStore the elastic launcher hosts, outside every
worker, so a dead worker takes no state with it). Each worker gets a sequence number when it first arrives; the
members of a round, in sequence order, are its ranks, so survivors keep their relative order and newcomers come
last. Who is alive is :mod:`gradsync.elastic.liveness`'s question (heartbeats, and exits reported by launchers).

A round: every live worker registers; the first to claim the round's leadership (``compare_set``) waits until
every live member registered (a live one may first have to time out of a collective), then writes the round's
member list; everyone reads it, and each member forms a fresh gloo group on a store prefix of its own
(``round<k>/``), with no process restart. A round whose leader dies before naming the members is skipped.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from typing import NoReturn

import torch.distributed as dist

from gradsync.collectives.peer_errors import post_gone
from gradsync.elastic.liveness import PREFIX, Liveness, mark_exited
from gradsync.errors import GradsyncError

STORE_VARIABLE = "GRADSYNC_ELASTIC_STORE"  # host:port of the job's store, set by `gradsync run --elastic`
WORKER_VARIABLE = "GRADSYNC_ELASTIC_WORKER"  # this process's id, so that its launcher can report its exit
SETTLE_S = 1.0
JOIN_WAIT_S = 600.0  # a joiner waits this long for the next step boundary to admit it
log = logging.getLogger("gradsync")


class MembershipChanged(GradsyncError):
    """A member died, stalled or a worker asked to join: the group must be formed again (handled by elastic.run)."""


class JobFinished(GradsyncError):
    """A worker started (or restarted) too late: the others already finished the training."""

    def leave(self, job: Membership) -> NoReturn:
        """Nothing left to do: exit with success (the launcher then restarts nothing)."""
        job.stop()
        log.warning("gradsync elastic: %s; exiting", self)
        sys.exit(0)


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
    """This worker's view of the job; ``connect()`` from the environment ``gradsync run --elastic`` sets."""

    def __init__(self, store: dist.Store, beat_store: dist.Store, timeout: float) -> None:
        self.store = store
        self.timeout = timeout
        self.me = store.add(PREFIX + "sequence", 1)
        if os.environ.get(WORKER_VARIABLE):
            store.set(f"{PREFIX}worker/{os.environ[WORKER_VARIABLE]}", str(self.me))
        self.round: Round | None = None
        self.joined_late = False  # admitted into a running job: it receives the members' state first
        self._tried = 0  # the last round number this worker registered for
        self._group_store: tuple[Round, dist.Store] | None = None  # the current round's group store, as torch has it
        self.liveness = Liveness(beat_store, self.me, timeout, on_gone=self._tell_members)

    @classmethod
    def connect(cls, timeout: float) -> Membership:
        where = os.environ.get(STORE_VARIABLE)
        if not where:
            raise GradsyncError(
                f"elastic training needs the job's store: start the job with `gradsync run --elastic ...` (it sets "
                f"{STORE_VARIABLE})."
            )
        host, port = where.rsplit(":", 1)
        stores = [dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=60)) for _ in "ab"]
        return cls(stores[0], stores[1], timeout)

    def stop(self) -> None:
        self.liveness.stop()

    def finished(self) -> None:
        """This worker's training function returned: the store host may close once every member has."""
        self.store.set(PREFIX + "done", "1")  # a worker still waiting to join need not
        self.store.add(PREFIX + "finished", 1)
        self.stop()

    def job_done(self) -> bool:
        return job_done(self.store)

    # ------------------------------------------------------------------------------------------- joining
    def job_running(self) -> bool:
        return self._check("current_round")

    def first_round(self, expected: int, seconds: float = 300.0) -> Round:
        """The job's first round: the first worker to arrive waits for ``expected`` in all (at most ``seconds``)."""
        key = f"{PREFIX}round1/"
        self.store.set(f"{key}registered/{self.me}", "1")
        if self.me == 1:
            deadline = time.monotonic() + seconds
            while int(self.store.add(PREFIX + "sequence", 0)) < expected and time.monotonic() < deadline:
                time.sleep(0.02)
            registered = [s for s in range(1, int(self.store.add(PREFIX + "sequence", 0)) + 1)]
            while not all(self._check(f"round1/registered/{s}") for s in registered):
                time.sleep(0.02)
            self.store.set(f"{key}members", json.dumps(registered))
            self.store.set(PREFIX + "current_round", "1")
        return self._enter(1, self._wait_for(f"{key}members", seconds + SETTLE_S))

    def _enter(self, number: int, members: list[int]) -> Round:
        if self.me not in members:
            raise GradsyncError(f"worker {self.me} was left out of round {number} (declared dead); exiting")
        self.round = Round(number, members, self.me)
        self.liveness.watch_only(members)
        self.store.set(f"{PREFIX}joined/{self.me}", "1")
        return self.round

    def request_to_join(self) -> None:
        self.joined_late = True
        self.store.delete_key(f"{PREFIX}joined/{self.me}")  # a member left out of a round joins again
        self.store.set(f"{PREFIX}joiners/{self.me}", "1")

    def pending_joiners(self) -> list[int]:
        count = int(self.store.add(PREFIX + "sequence", 0))
        return [s for s in range(1, count + 1) if self._check(f"joiners/{s}") and not self._check(f"joined/{s}")]

    def _check(self, key: str) -> bool:
        return self.store.check([PREFIX + key])

    # --------------------------------------------------------------------------------------------- rounds
    def next_round(self) -> Round:
        """Agree on the next round's members: the current members still alive and the workers waiting to join.
        Every live member calls this; a worker joining calls it after :meth:`request_to_join`."""
        if self.round is None:
            return self._join_a_round()
        # A round whose leader died before naming the members is skipped: everyone tries the next number.
        number = max(self.round.number, self._tried) + 1
        self._tried = number
        key = f"{PREFIX}round{number}/"
        self.store.set(f"{key}registered/{self.me}", "1")
        if self.store.compare_set(f"{key}leader", "", str(self.me)).decode() == str(self.me):
            self._decide(number)
        members = self._wait_for(f"{key}members", 2 * (SETTLE_S + self.timeout))
        if self.me not in members:  # declared dead (cut off, or stopped for too long): join again, in-process
            log.warning("gradsync elastic: worker %d was left out of round %d; asking to join again", self.me, number)
            self.request_to_join()
            self.round = None
            return self._join_a_round()
        return self._enter(number, members)

    def _join_a_round(self) -> Round:
        """A joiner registers for the round after the latest formed, and tries the next one if that round formed
        without it (it registered too late); the members admit it at a step boundary."""
        deadline = time.monotonic() + JOIN_WAIT_S
        while time.monotonic() < deadline:
            if self.job_done():
                raise JobFinished("the job finished before this worker could join")
            number = self._current_round() + 1
            key = f"{PREFIX}round{number}/"
            self.store.set(f"{key}registered/{self.me}", "1")
            members = self._wait_for(f"{key}members", max(1.0, deadline - time.monotonic()), give_up="done")
            if self.me in members:
                return self._enter(number, members)
            self.store.delete_key(f"{PREFIX}joined/{self.me}")  # marked expired by that round: still joining
        raise GradsyncError(f"worker {self.me} was not admitted within {JOIN_WAIT_S:.0f}s")

    def _decide(self, number: int) -> None:
        key = f"{PREFIX}round{number}/"
        current = self.round.members if self.round is not None else []
        joiners = self.pending_joiners()
        # Members keep their order and joiners come last, so rank 0 (whose state everyone receives) is a member that
        # lived through the change: a worker that was cut off and asks to join again keeps its old, low number.
        wanted = current + sorted(set(joiners) - set(current))
        # A live member may be inside a collective that fails only at the group's timeout: wait for it that long.
        deadline = time.monotonic() + SETTLE_S + self.timeout
        while time.monotonic() < deadline:
            live = [m for m in wanted if self.liveness.alive(m)]
            if all(self.store.check([f"{key}registered/{m}"]) for m in live):
                break
            time.sleep(0.02)
        # Registered and still alive: a worker killed after registering (its launcher reported it) is left out.
        members = [m for m in wanted if self.store.check([f"{key}registered/{m}"]) and self.liveness.alive(m)]
        for gone in set(joiners) - set(members):  # asked to join, then vanished: stop waiting for it
            self.store.set(f"{PREFIX}joined/{gone}", "expired")
        self.store.set(f"{key}members", json.dumps(members))
        self.store.set(PREFIX + "current_round", str(number))

    def _current_round(self) -> int:
        return int(self.store.get(PREFIX + "current_round")) if self._check("current_round") else 0

    def _wait_for(self, key: str, seconds: float, give_up: str | None = None) -> list[int]:
        deadline = time.monotonic() + seconds
        while not self.store.check([key]):
            if give_up and self._check(give_up):  # e.g. "done": the members finished
                raise JobFinished("the job finished before this worker could join")
            if time.monotonic() > deadline:
                raise MembershipChanged(f"no member list at {key} within {seconds:.0f}s: the round's leader died")
            time.sleep(0.02)
        return json.loads(self.store.get(key))

    def form_group(self, round_: Round) -> None:
        """A fresh default process group for ``round_`` (the previous one, if any, is destroyed first)."""
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # a group with dead members may not close cleanly; it is dropped either way
                pass
        prefix = dist.PrefixStore(f"{PREFIX}round{round_.number}/group/", self.store)
        try:
            dist.init_process_group(
                "gloo",
                store=prefix,
                rank=round_.rank,
                world_size=round_.world_size,
                timeout=datetime.timedelta(seconds=self.timeout),  # a stopped member is found within this
            )
        except dist.DistError as exc:  # a member died while the group formed: the next round goes without it
            # The default group's store keys carry a per-process counter of groups made, which
            # destroy_process_group resets to 0 "to allow consistent value ... after some trainers recover from
            # failure" (torch/distributed/distributed_c10d.py). A failed init bumps it with no group to destroy:
            # reset it too, or this worker's keys never match the others' again.
            dist.distributed_c10d._world.group_count = 0
            raise MembershipChanged(f"forming round {round_.number}'s group failed: {exc}") from exc
        self._group_store = (round_, dist.distributed_c10d._get_default_store())

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

    # --------------------------------------------------------------------------------------- agreement
    def agree(self, label: str) -> str:
        """Every member reached ``label`` (a step boundary); returns the leader's decision: "continue" or "admit"
        (joiners wait: form the next round). Raises :class:`MembershipChanged` if a member died meanwhile.

        The decision is one key, written once (``compare_set``): the leader writes "continue" or "admit" after
        every member's flag; a member that finds another dead writes "abort". Whoever writes first decides for
        everyone, so a member cut off mid-step cannot come back and commit a step the others abandoned."""
        assert self.round is not None
        key = f"{PREFIX}round{self.round.number}/{label}/"
        self.store.set(f"{key}{self.me}", "1")
        leader = self.round.members[0]
        for member in self.round.members:
            while not self._decided(key) and not self.store.check([f"{key}{member}"]):
                if not self.liveness.alive(member):
                    self._abort(key, f"member {member} {self.liveness.why_dead(member)} at {label}")
                time.sleep(0.001)
        if self.round.rank == 0:
            self.store.compare_set(f"{key}decision", "", "admit" if self.pending_joiners() else "continue")
        while not self._decided(key):
            if not self.liveness.alive(leader):
                self._abort(key, f"the leader {leader} stopped at {label}")
            time.sleep(0.001)
        decision = self.store.get(f"{key}decision").decode()
        if decision == "abort":
            raise MembershipChanged(f"the step at {label} was abandoned: a member was lost")
        return decision

    def _decided(self, key: str) -> bool:
        return self.store.check([f"{key}decision"])

    def _abort(self, key: str, why: str) -> None:
        """Abandon the step unless the leader decided first (then follow its decision)."""
        if self.store.compare_set(f"{key}decision", "", "abort").decode() == "abort":
            raise MembershipChanged(why)


def report_exit(store: dist.Store, worker: str) -> None:
    """Called by a launcher when its worker ``worker`` (its WORKER_VARIABLE) exited: the members stop waiting for it."""
    key = f"{PREFIX}worker/{worker}"
    if store.check([key]):
        mark_exited(store, int(store.get(key)))


def job_done(store: dist.Store) -> bool:
    """Whether the members finished training (a launcher then restarts no worker)."""
    return store.check([PREFIX + "done"])


def everyone_finished(store: dist.Store) -> bool:
    """Whether every member of the latest round reported its training finished (the store's host may close)."""
    if not store.check([PREFIX + "current_round"]):
        return False
    members = json.loads(store.get(f"{PREFIX}round{int(store.get(PREFIX + 'current_round'))}/members"))
    return int(store.add(PREFIX + "finished", 0)) >= len(members)
