"""Agreeing on a round's members when a fault lands inside the agreement (gradsync/elastic/rounds.py), in one
process: workers are Membership objects on one store, each with its own heartbeat thread, and a fault is what a
launcher writes when its worker exits (verdicts.mark_exited)."""

from __future__ import annotations

import json
import logging
import random
import re
import threading
import time
from collections.abc import Iterator

import pytest
import torch.distributed as dist

from gradsync.collectives.activity import CollectiveActivity
from gradsync.elastic import keys, liveness, verdicts
from gradsync.elastic.errors import JobStateLost, MembershipChanged
from gradsync.elastic.job_status import find_state_lost, state_lost
from gradsync.elastic.membership import Membership
from gradsync.elastic.rounds import SETTLE_S
from gradsync.elastic.timeouts import Timeouts
from gradsync.elastic.verdicts import Verdicts, beat_since, lost_mark, mark_exited
from gradsync.errors import GradsyncError
from gradsync.launch.elastic import Job
from gradsync.polling import wait_until

TIMEOUTS = Timeouts(heartbeat=3.0, collective=3.0, admission=20)
GIVE_UP_S = 2 * (SETTLE_S + TIMEOUTS.collective)  # what a member waits for a list no leader wrote


@pytest.fixture()
def store() -> dist.Store:
    return dist.HashStore()


@pytest.fixture()
def workers(store: dist.Store) -> Iterator[list[Membership]]:
    made: list[Membership] = []
    yield made
    for worker in made:
        worker.stop()


def _first_round(
    store: dist.Store, workers: list[Membership], count: int, timeouts: Timeouts = TIMEOUTS, activity=None
) -> None:
    """``activity(k)``: the k-th worker's CollectiveActivity (default: none watched)."""
    workers += [Membership(store, store, timeouts, activity=activity and activity(k)) for k in range(count)]
    threads = [threading.Thread(target=w.first_round, args=(count, 20)) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(w.round is not None and w.round.members == [1, 2, 3][:count] for w in workers)


def _claim_and_die(store: dist.Store, worker: Membership, round_number: int) -> None:
    """``worker`` claims ``round_number``'s leadership and dies before naming the members."""
    store.set(keys.registered(round_number, worker.me), "0")
    assert store.compare_set(keys.leader(round_number), "", str(worker.me)) == str(worker.me).encode()
    worker.stop()
    mark_exited(store, worker.me)


@pytest.mark.timeout(60)
def test_a_round_whose_leader_dies_deciding_is_abandoned_at_once(store: dist.Store, workers: list) -> None:
    _first_round(store, workers, 3)
    survivor, other, leader = workers
    _claim_and_die(store, leader, 2)
    start = time.monotonic()
    with pytest.raises(MembershipChanged, match="abandoned: its leader, worker 3, exited"):
        survivor.next_round(steps=5)
    assert time.monotonic() - start < 1.0, f"waited {time.monotonic() - start:.1f}s, not at once ({GIVE_UP_S}s)"
    assert "abandoned" in json.loads(store.get(keys.members(2)))
    # Every member then tries the next number (the other one learns of the abandonment first), which forms
    # without the dead leader.
    rounds: dict[int, list[int]] = {}
    elsewhere = threading.Thread(target=lambda: rounds.update({other.me: _agree(other).members}))
    elsewhere.start()
    rounds[survivor.me] = _agree(survivor).members
    elsewhere.join(30)
    assert rounds == {1: [1, 2], 2: [1, 2]}


@pytest.mark.timeout(60)
def test_a_round_whose_leader_is_lost_with_its_host_is_abandoned_once_its_heartbeat_stood_still(
    store: dist.Store, workers: list
) -> None:
    """The 8-host soak at 70e2da7: a round's leader lost with its host (no launcher left to report the exit) kept
    its members waiting the heartbeat timeout, 5.4 s, 4 times. Its heartbeat standing still for 3 beats is enough."""
    _first_round(store, workers, 3)
    survivor, _, leader = workers
    store.set(keys.registered(2, leader.me), "0")
    assert store.compare_set(keys.leader(2), "", str(leader.me)) == str(leader.me).encode()
    leader.stop()  # lost with its host: its heartbeat stops, and no exit is reported
    start = time.monotonic()
    with pytest.raises(MembershipChanged, match="its leader, worker 3, whose heartbeat stood still for 0.[0-9]s"):
        survivor.next_round(steps=5)
    waited = time.monotonic() - start
    assert waited < 1.5, f"waited {waited:.1f}s for a silent leader (heartbeat timeout: {TIMEOUTS.heartbeat:g}s)"


@pytest.mark.timeout(60)
def test_a_deciding_leader_sees_an_exit_reported_meanwhile_at_its_next_look(
    store: dist.Store, workers: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker killed inside an all-reduce: the survivors begin the next round before its launcher reports the
    exit. The leader waiting for the live members to register reads the verdicts counter each look (verdicts.Verdicts),
    not only when its heartbeat thread next beats (2 s apart here, so the beat cannot be what sees it)."""
    monkeypatch.setattr(liveness, "HEARTBEAT_S", 2.0)
    slow = Timeouts(heartbeat=10.0, collective=10.0, admission=20)
    workers += [Membership(store, store, slow) for _ in range(3)]
    firsts = [threading.Thread(target=w.first_round, args=(3, 20)) for w in workers]
    for t in firsts:
        t.start()
    for t in firsts:
        t.join(30)
    *survivors, dead = workers
    dead.stop()  # killed: its heartbeat stops, and its launcher has not reported the exit yet
    formed: dict[int, list[int]] = {}
    threads = [
        threading.Thread(target=lambda w=w: formed.update({w.me: w.next_round(steps=5).members})) for w in survivors
    ]
    for t in threads:
        t.start()
    time.sleep(0.5)
    assert not formed, "a round formed without waiting for a member neither reported nor suspected (6 s)"
    reported = time.monotonic()
    mark_exited(store, dead.me)
    for t in threads:
        t.join(30)
    waited = time.monotonic() - reported
    assert formed == {1: [1, 2], 2: [1, 2]}
    assert waited < 0.5, f"the leader saw the reported exit after {waited:.2f}s (its heartbeat beats every 2 s)"


@pytest.mark.timeout(60)
def test_a_deciding_leader_goes_without_a_member_its_watcher_saw_stand_still(store: dist.Store, workers: list) -> None:
    """A host lost whole (no launcher left to report the exit). The member watching it (the ring: 2 watches 3) saw
    its heartbeat stand still for 3 beats and posted it (verdicts.Suspicions); the leader, which never watched it,
    does not count 3 beats of its own from its first look (0.3 s at least, the host kind's pause in the soak)."""
    _first_round(store, workers, 3)
    leader, watcher, lost = workers
    lost.stop()  # its heartbeat stops, and no exit is reported
    assert wait_until(lambda: store.check([keys.suspected(lost.me)]), 5)
    assert f"its watcher, worker {watcher.me}, saw" in store.get(keys.suspected(lost.me)).decode()
    formed: dict[int, list[int]] = {}
    deciding = threading.Thread(target=lambda: formed.update({leader.me: leader.next_round(steps=5).members}))
    began = time.monotonic()
    deciding.start()
    assert wait_until(lambda: store.check([keys.leader(2)]), 5)  # worker 1 leads: it never watched worker 3
    formed[watcher.me] = watcher.next_round(steps=5).members
    deciding.join(30)
    took = time.monotonic() - began
    assert formed == {1: [1, 2], 2: [1, 2]}
    assert took < 0.25, f"the round took {took:.2f}s: its leader counted the lost member's still beats itself"


@pytest.mark.timeout(60)
def test_a_deciding_leader_goes_without_a_member_whose_step_stalled(
    store: dist.Store, workers: list, caplog: pytest.LogCaptureFixture
) -> None:
    """A member stuck in a step, its heartbeat beating (the issue's "stuck step"): its own heartbeat thread posts
    that its training thread has been outside every collective past the collective timeout, so the leader does not
    wait another timeout for it to register; it takes the mark back once it touches a collective."""
    timeouts = Timeouts(heartbeat=10.0, collective=1.0, admission=20)
    activities = [CollectiveActivity() for _ in range(3)]
    for busy in activities[:2]:
        busy.enter()  # inside the collective that fails; the third is stuck before it
    _first_round(store, workers, 3, timeouts, activity=activities.__getitem__)
    leader, other, stuck = workers
    assert wait_until(lambda: store.check([keys.stalled(stuck.me)]), 5)
    assert not store.check([keys.stalled(leader.me)]) and not store.check([keys.stalled(other.me)])
    formed: dict[int, list[int]] = {}
    deciding = threading.Thread(target=lambda: formed.update({leader.me: leader.next_round(steps=5).members}))
    began = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="gradsync"):
        deciding.start()
        assert wait_until(lambda: store.check([keys.leader(2)]), 5)
        formed[other.me] = other.next_round(steps=5).members
        deciding.join(30)
    took = time.monotonic() - began
    assert formed == {1: [1, 2], 2: [1, 2]}
    # Without the mark: SETTLE_S + the collective timeout, 2 s.
    assert took < 0.5, f"the round took {took:.2f}s: its leader waited for the stalled member"
    assert "round 2 goes on without worker 3: its training thread had been outside every collective" in caplog.text
    activities[2].enter()  # it woke and touched a collective: the mark goes
    assert wait_until(lambda: not store.check([keys.stalled(stuck.me)]), 5)
    assert not stuck.finished_while_stalled()


def test_a_stalled_worker_learns_that_the_job_finished_and_ends_with_it(store: dist.Store) -> None:
    """The job's TCPStore closes with the job: a worker stalled in a step must learn of the end before then, so that
    when it wakes it ends with status 0 (JobFinished) instead of failing on a store that is gone."""
    stalled, busy = CollectiveActivity(), CollectiveActivity()
    busy.enter()
    looks = [verdicts.Stall(1, stalled, seconds=0.0), verdicts.Stall(2, busy, seconds=0.0)]
    for stall in looks:
        stall.look(store)
    assert not any(stall.job_finished.is_set() for stall in looks)
    store.set(keys.DONE, "1")
    for stall in looks:
        stall.look(store)
    assert looks[0].job_finished.is_set()
    assert not looks[1].job_finished.is_set()  # a worker inside a collective learns it there


def test_a_launcher_whose_worker_fails_after_the_job_finished_does_not_call_the_store_lost() -> None:
    """The store's host closes its TCPStore once the members finished: a launcher reporting an exit afterwards (its
    worker woke from a stuck step) must not call that a lost store, which means "restart the job from its last
    checkpoint", for a job that succeeded."""
    from gradsync.launch.elastic import Worker

    class Closed(dist.HashStore):
        def check(self, keys: list[str]) -> bool:
            raise dist.DistNetworkError("Broken pipe")

    store = dist.HashStore()
    store.set(keys.DONE, "1")
    job = Job(store, "10.0.0.1:29650", hosting=False)
    job.look()
    assert job.done
    job.store = Closed()
    job.report_exit(Worker(0, "node"))
    assert job.lost is None


def test_a_suspicion_holds_until_the_member_beats_again(store: dist.Store) -> None:
    store.set(keys.beat(2), "7")
    verdicts.post(store, keys.suspected(2), lost_mark(7, "its watcher, worker 1, saw its heartbeat stand still"), 2)
    known = Verdicts(store, [1, 2], since=0)
    assert known.suspected(2, count=7) and not known.suspected(2, count=8)  # the leader saw it beat since
    assert not known.suspected(1, count=0) and not known.gone
    store.set(keys.beat(2), "8")  # it beat before the leader read the mark: the mark holds against no one
    assert not Verdicts(store, [1, 2], since=None).suspected(2, count=0)


def test_verdicts_read_from_their_tickets_match_a_full_read_each_look(store: dist.Store) -> None:
    """The leader reads the members the tickets since the current round name, when the counter moved; the
    reference reads every mark of every member each look. A verdict whose ticket is not written yet (counted, its
    mark set) makes the leader read everything."""
    rng = random.Random(0)
    wanted = list(range(1, 9))
    for member in wanted:
        store.set(keys.beat(member), "1")
    known, late = Verdicts(store, wanted, since=0), None
    for _ in range(400):
        member, action = rng.choice(wanted), rng.random()
        count = int(store.get(keys.beat(member)))
        if late is not None:  # last look's unwritten ticket
            store.set(keys.verdict(late[0]), str(late[1]))
            late = None
        if action < 0.3:  # it beats again: its next verdict (any) names it
            store.set(keys.beat(member), str(count + 1))
            verdicts.post(store, keys.suspected(member), lost_mark(count, "still"), member)
        elif action < 0.6:
            verdicts.post(store, keys.suspected(member), lost_mark(count, "still"), member)
        elif action < 0.7:
            verdicts.post(store, keys.lost(member), lost_mark(count, "stopped"), member)
        elif action < 0.75:
            mark_exited(store, member)
        elif action < 0.85:  # counted and set, its ticket written after the leader's look
            store.set(keys.suspected(member), lost_mark(count, "still"))
            late = (int(store.add(keys.VERDICTS, 1)), member)
        known.look()
        reference = Verdicts(store, wanted, since=None)
        assert known.gone == reference.gone
        seen = {m: int(store.get(keys.beat(m))) for m in wanted}
        assert {m for m in wanted if known.suspected(m, seen[m])} == {
            m for m in wanted if reference.suspected(m, seen[m])
        }


def _agree(worker: Membership, tries: int = 3):
    """What elastic.run's recovery does: the next round, again while rounds are abandoned."""
    for _ in range(tries - 1):
        try:
            return worker.next_round(steps=5)
        except MembershipChanged:
            pass
    return worker.next_round(steps=5)


@pytest.mark.timeout(60)
def test_a_joiner_follows_the_members_past_a_round_its_leader_never_named(store: dist.Store, workers: list) -> None:
    _first_round(store, workers, 2)
    member, leader = workers
    joiner = Membership(store, store, TIMEOUTS)
    workers.append(joiner)
    joiner.request_to_join()
    joined: list = []
    waiting = threading.Thread(target=lambda: joined.append(joiner.next_round()))
    waiting.start()  # it registers for round 2, the one after the latest formed
    _claim_and_die(store, leader, 2)
    with pytest.raises(MembershipChanged):
        member.next_round(steps=5)
    start = time.monotonic()
    assert member.next_round(steps=5).members == [member.me, joiner.me]  # round 3, the joiner registered for it
    waiting.join(30)
    assert joined[0].number == 3 and joined[0].members == [member.me, joiner.me]
    assert time.monotonic() - start < SETTLE_S + 1.0, "the leader waited out the joiner's registration"


@pytest.mark.timeout(60)
def test_a_joiner_a_round_formed_without_asks_again(store: dist.Store, workers: list) -> None:
    """A round that formed without a joiner counted its request: the joiner asks again, or no rank 0 would ever
    announce its admission."""
    _first_round(store, workers, 1)
    joiner = Membership(store, store, TIMEOUTS)
    workers.append(joiner)
    joiner.request_to_join()
    joined: list = []
    waiting = threading.Thread(target=lambda: joined.append(joiner.next_round()))
    waiting.start()
    assert wait_until(lambda: store.check([keys.registered(2, joiner.me)]), 5)
    store.set(keys.members(2), json.dumps([1]))  # round 2 formed without it (it registered too late)
    store.set(keys.requests(2), "1")
    store.set(keys.CURRENT_ROUND, "2")
    assert wait_until(lambda: int(store.add(keys.JOIN_REQUESTS, 0)) == 2, 5), "it did not ask again"
    store.set(keys.members(3), json.dumps([1, joiner.me]))
    store.set(keys.requests(3), "2")
    waiting.join(30)
    assert joined[0].number == 3 and joined[0].rank == 1


@pytest.mark.timeout(60)
def test_a_joiner_and_the_launchers_stop_when_every_member_holding_the_state_exited(
    store: dist.Store, workers: list
) -> None:
    """The 8-host soak's end before its fix: both members of the last round killed, eight joiners waited out
    their 600 s admission, were restarted, and waited again, for a state no process held. Now the job stops,
    saying why, within a second or two, and no launcher restarts a worker into it."""
    _first_round(store, workers, 2)
    for worker in workers:
        worker.stop()
        mark_exited(store, worker.me)
    joiner = Membership(store, store, TIMEOUTS)
    workers.append(joiner)
    joiner.request_to_join()
    start = time.monotonic()
    with pytest.raises(JobStateLost, match=r"cannot join: every member of round 1 \(workers 1, 2\) exited"):
        joiner.next_round()
    assert time.monotonic() - start < 3.0, "not at once: the admission timeout is 20 s"
    job = Job(store, "test", hosting=True)
    job.look()
    assert job.state_lost is not None and "Restart the job from its last checkpoint" in job.state_lost


@pytest.mark.timeout(60)
def test_a_joiner_says_who_it_waits_for_when_every_state_holder_went_silent(
    store: dist.Store, workers: list, caplog: pytest.LogCaptureFixture
) -> None:
    """The 8-host chaos lab's first run: a round of 1 whose host was lost whole (no launcher left to report the
    exit), and every joiner waited out its 600 s admission without a word. Silence stops nothing (a member cut off
    may come back with the state), but the joiner says whom it waits for and until when, and its error says why."""
    _first_round(store, workers, 2)
    for worker in workers:
        worker.stop()  # their heartbeats stop and no exit is reported: their hosts were lost whole
    joiner = Membership(store, store, Timeouts(heartbeat=1.0, collective=1.0, admission=4.0))
    workers.append(joiner)
    joiner.request_to_join()
    lost = r"every member of round 1 \(workers 1, 2\), which hold the job's training state, has been silent for \d+s"
    with caplog.at_level(logging.WARNING, logger="gradsync"):
        with pytest.raises(GradsyncError, match=rf"not admitted within 4s .*: {lost}.*restart the job from its last"):
            joiner.next_round()
    said = [r.getMessage() for r in caplog.records if "waits to join" in r.getMessage()]
    assert len(said) == 1 and re.search(lost, said[0]) and "admission timeout (4s" in said[0], said


@pytest.mark.timeout(60)
def test_a_member_left_with_an_old_state_does_not_stop_the_job_while_one_holding_it_lives(
    store: dist.Store, workers: list
) -> None:
    """Only an exit is final: a member declared lost (cut off) may come back with the state, so its loss alone
    stops nothing."""
    _first_round(store, workers, 2)
    store.set(keys.lost(workers[1].me), "stopped (no heartbeat for 3s)")
    mark_exited(store, workers[0].me)
    assert find_state_lost(store) is None and state_lost(store) is None


@pytest.mark.timeout(60)
def test_a_round_that_goes_without_a_joiner_writes_why_for_the_joiner_to_say(store: dist.Store, workers: list) -> None:
    """The 8-host soak's last 8 minutes: one rejoiner left out of round after round, silently. A round that goes
    without a joiner now says why in its joined key, which the joiner logs before it asks again."""
    _first_round(store, workers, 2)
    joiner = Membership(store, store, TIMEOUTS)
    workers.append(joiner)
    joiner.request_to_join()  # asks, but does not register for round 2 (as if it were still starting)
    rounds: dict[int, list[int]] = {}
    threads = [threading.Thread(target=lambda w=w: rounds.update({w.me: w.next_round(5).members})) for w in workers[:2]]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert rounds == {1: [1, 2], 2: [1, 2]}
    said = store.get(keys.joined(joiner.me)).decode()
    assert said.startswith("expired: it had not registered for round 2 when worker"), said


@pytest.mark.timeout(60)
def test_a_stale_lost_mark_leaves_no_rejoiner_out(store: dist.Store, workers: list) -> None:
    """The 8-host soak's livelock: a worker cut off by a split came back in-process and asked to join, but a
    watcher's lost mark landed after it had deleted it, and every round after left it out (160 rounds, its
    heartbeat moving all along). A mark now carries the count its watcher last saw, and a member that beat since
    is not gone."""
    _first_round(store, workers, 2)
    joiner = Membership(store, store, TIMEOUTS)
    workers.append(joiner)
    joiner.request_to_join()
    store.set(keys.lost(joiner.me), lost_mark(0, "stopped (no heartbeat for 3s)"))  # written after it asked
    assert wait_until(lambda: int(store.add(keys.beat(joiner.me), 0)) > 0, 5)  # and it beats on
    joined: list = []
    waiting = threading.Thread(target=lambda: joined.append(joiner.next_round()))
    waiting.start()
    assert wait_until(lambda: store.check([keys.registered(2, joiner.me)]), 5)
    rounds: dict[int, list[int]] = {}
    threads = [threading.Thread(target=lambda w=w: rounds.update({w.me: w.next_round(5).members})) for w in workers[:2]]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    waiting.join(30)
    assert rounds == {1: [1, 2, 3], 2: [1, 2, 3]} and joined[0].members == [1, 2, 3]


def test_a_lost_mark_holds_until_the_member_beats_again() -> None:
    mark = lost_mark(41, "stopped (no heartbeat for 5s)")
    assert not beat_since(mark, 41) and beat_since(mark, 42)
    assert not beat_since("stopped (no heartbeat for 5s)", 99)  # a mark without a count never expires
