"""The gate before a round's group forms (gradsync/elastic/round_group.py): a member known gone calls the round off
at once, instead of every survivor waiting out the group's timeout inside init_process_group."""

from __future__ import annotations

import re
import threading
import time

import pytest
import torch
import torch.distributed as dist

from gradsync import torch_private
from gradsync.elastic import keys, round_group
from gradsync.elastic.errors import MembershipChanged
from gradsync.elastic.liveness import SUSPECT_BEATS, Liveness
from gradsync.elastic.round_group import FLOOR_S, MARGIN, ConnectTimeout, RoundGroup
from gradsync.elastic.rounds import Round
from gradsync.elastic.timeouts import Timeouts


def _arrive_in_thread(store: dist.Store, round_: Round, seconds: float, outcome: dict) -> threading.Thread:
    def run() -> None:
        began = time.monotonic()
        try:
            round_group.arrive(store, round_, seconds)
            outcome[round_.me] = ("open", time.monotonic() - began)
        except MembershipChanged as exc:
            outcome[round_.me] = (str(exc), time.monotonic() - began)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


@pytest.mark.timeout(30)
def test_the_gate_opens_when_every_member_arrived() -> None:
    store, outcome = dist.HashStore(), {}
    threads = [_arrive_in_thread(store, Round(2, [4, 7, 9], me), 10.0, outcome) for me in (4, 7, 9)]
    for t in threads:
        t.join(15)
    assert {me: verdict for me, (verdict, _) in outcome.items()} == {4: "open", 7: "open", 9: "open"}


@pytest.mark.timeout(30)
def test_a_member_seen_gone_calls_the_round_off_at_once() -> None:
    store, outcome = dist.HashStore(), {}
    round_ = Round(3, [1, 2, 3], 1)  # member 3 never arrives
    threads = [_arrive_in_thread(store, Round(3, [1, 2, 3], me), 10.0, outcome) for me in (1, 2)]
    time.sleep(0.2)
    round_group.call_off(store, round_.number, "worker 3 exited (its launcher saw it)")
    for t in threads:
        t.join(15)
    for why, seconds in outcome.values():
        assert why == "gradsync: round 3's group was called off: worker 3 exited (its launcher saw it)"
        assert seconds < 2.0  # not the 10 s timeout
    round_group.call_off(store, round_.number, "too late")  # a second call changes nothing
    assert store.get("gradsync/elastic/round3/gate") == b"worker 3 exited (its launcher saw it)"


@pytest.mark.timeout(30)
def test_with_no_one_seen_gone_the_gate_waits_its_timeout_and_says_who_came() -> None:
    store, outcome = dist.HashStore(), {}
    _arrive_in_thread(store, Round(5, [1, 2], 1), 0.5, outcome).join(10)
    why, seconds = outcome[1]
    assert "round 5: 1 of its 2 members reached its group within 0s" in why and seconds >= 0.5


@pytest.mark.timeout(30)
def test_the_heartbeat_threads_report_calls_a_forming_round_off() -> None:
    store = dist.HashStore()
    group = RoundGroup(store, Timeouts(heartbeat=5, collective=10), alarm_store=store)
    failure: dict = {}

    def form() -> None:
        began = time.monotonic()
        try:
            group.form(Round(2, [0, 1], 0))
        except MembershipChanged as exc:
            failure["why"], failure["seconds"] = str(exc), time.monotonic() - began

    thread = threading.Thread(target=form)
    thread.start()
    time.sleep(0.3)
    group.tell_members(1, "exited (its launcher saw it)", 7)  # as Liveness's on_gone, from the heartbeat thread
    thread.join(15)
    assert failure["why"] == "gradsync: round 2's group was called off: worker 1 exited (its launcher saw it)"
    assert failure["seconds"] < 2.0
    assert not dist.is_initialized()  # no group was formed


@pytest.mark.timeout(30)
def test_a_peer_gloo_cannot_reach_as_the_group_forms_is_a_membership_change_not_a_crash(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The 8-host chaos soak's lost job: a member's link went down after the gate opened, and every other member's
    ``init_process_group`` raised gloo's plain RuntimeError, out of the recovery: each exited, and the job's state
    with them. It is the next round's business, as a store timeout there is; any other error still propagates."""
    store = dist.HashStore()
    group = RoundGroup(store, Timeouts(heartbeat=5.0, collective=5.0, admission=60.0), alarm_store=store)
    round_ = Round(7, [3, 5], 3)
    store.add("gradsync/elastic/round7/arrived", 1)  # the other member is at the gate: it opens for this one
    unreachable = (
        "Gloo connectFullMesh failed with [.../gloo/transport/tcp/pair.h:311] Connect timeout [10.77.0.6]:33449"
    )

    def fails(*args: object, **kwargs: object) -> None:
        raise RuntimeError(unreachable)

    monkeypatch.setattr(dist, "init_process_group", fails)
    failed = "forming round 7's group failed after [0-9.]+s: Gloo connectFullMesh failed"
    with pytest.raises(MembershipChanged, match=failed):
        group.form(round_)

    def misconfigured(*args: object, **kwargs: object) -> None:
        raise RuntimeError("Invalid backend: 'glo'")

    monkeypatch.setattr(dist, "init_process_group", misconfigured)
    store.add("gradsync/elastic/round8/arrived", 1)
    with pytest.raises(RuntimeError, match="Invalid backend"):
        group.form(Round(8, [3, 5], 3))


@pytest.mark.timeout(60)
def test_a_traceback_after_many_rounds_bears_one_rank_prefix_the_current_one(capsys: pytest.CaptureFixture) -> None:
    """torch's init_process_group wraps sys.excepthook to prefix "[rank<r>]: " around the hook before it: a worker
    of the soak printed tracebacks with 40 prefixes, the first from its first round. One prefix, this round's."""
    import sys

    store, before = dist.HashStore(), sys.excepthook
    sys.excepthook = sys.__excepthook__  # as a worker starts (other tests here formed groups, each wrapping it)
    group = RoundGroup(store, Timeouts(heartbeat=5.0, collective=5.0, admission=60.0), alarm_store=store)
    try:
        for number in (1, 2, 3):
            group.form(Round(number, [4], 4))
        try:
            raise ValueError("the user's bug")
        except ValueError:
            sys.excepthook(*sys.exc_info())
        lines = [line for line in capsys.readouterr().err.splitlines() if "ValueError:" in line]
        assert lines == ["[rank0]: ValueError: the user's bug"], lines
    finally:
        group.leave()
        sys.excepthook = before


@pytest.mark.timeout(30)
def test_a_member_whose_heartbeat_stood_still_a_few_beats_calls_the_forming_round_off() -> None:
    """The 8-host soak's gates that timed out (10, 5 s each): the missing member was dead, but no watcher calls a
    member gone before the heartbeat timeout. Its watcher now calls the round off once its heartbeat stood still
    for SUSPECT_BEATS beats; a member whose heartbeat moves is never suspected."""
    store = dist.HashStore()
    liveness = Liveness(store, 1, timeout=5.0)
    group = RoundGroup(store, Timeouts(heartbeat=5, collective=10), alarm_store=store)
    round_ = Round(4, [1, 2, 3], 1)
    liveness.watch_only(round_.members)  # member 1 watches 2, which never beats
    beating = threading.Event()

    def member_3_beats() -> None:
        count = 0
        while not beating.wait(0.1):
            count += 1
            store.set("gradsync/elastic/beat/3", str(count))

    threading.Thread(target=member_3_beats, daemon=True).start()
    liveness.alive(3)  # watched too: it beats, so it is never a suspect
    failure: dict = {}

    def form() -> None:
        began = time.monotonic()
        try:
            group.form(round_)
        except MembershipChanged as exc:
            failure["why"], failure["seconds"] = str(exc), time.monotonic() - began

    thread = threading.Thread(target=form)
    thread.start()
    deadline = time.monotonic() + 8
    while thread.is_alive() and time.monotonic() < deadline:
        group.call_off_for_suspects(liveness.suspects)  # as the heartbeat thread does each beat
        time.sleep(liveness.interval)
    thread.join(5)
    beating.set()
    liveness.stop()
    said = re.fullmatch(
        r"gradsync: round 4's group was called off: worker 2's heartbeat stood still for (\d\.\d)s as the round formed",
        failure["why"],
    )
    assert said is not None, failure
    assert float(said[1]) == pytest.approx(SUSPECT_BEATS * liveness.interval, abs=0.15)  # 0.3 s: 3 beats of 0.1 s
    assert failure["seconds"] < 2.5  # not the gate's 10 s


@pytest.mark.timeout(30)
def test_a_lost_member_is_marked_at_once_while_the_training_threads_connection_waits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A TCPStore client serves one request at a time: the mark the heartbeat thread wrote on the training thread's
    connection waited behind that thread's wait (the gate, the group's rendezvous, the next member list: seconds),
    and the heartbeat stopped meanwhile, so the member looked dead to the next round's leader."""
    import contextlib
    import datetime

    from gradsync import torch_private
    from gradsync.elastic import keys
    from gradsync.elastic.verdicts import lost_mark

    server = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    client = lambda: dist.TCPStore("127.0.0.1", server.port, 1, False, timeout=datetime.timedelta(seconds=10))  # noqa: E731
    training, beating = client(), client()
    group = RoundGroup(training, Timeouts(heartbeat=5, collective=5), alarm_store=beating)
    monkeypatch.setattr(dist, "init_process_group", lambda *args, **kwargs: None)  # a round of 2, one process
    monkeypatch.setattr(torch_private, "default_store", dist.HashStore)
    training.add("gradsync/elastic/round3/arrived", 1)  # the other member is at the gate
    group.form(Round(3, [1, 2], 1))

    def wait_for_the_next_list() -> None:
        with contextlib.suppress(dist.DistStoreError):
            training.wait(["gradsync/elastic/round4/members"], datetime.timedelta(seconds=3))

    waiting = threading.Thread(target=wait_for_the_next_list)
    waiting.start()
    time.sleep(0.2)
    began = time.monotonic()
    group.tell_members(2, "exited (its launcher saw it)", 7)  # from the heartbeat thread
    seconds = time.monotonic() - began
    waiting.join()
    assert seconds < 0.5, f"the mark waited {seconds:.1f}s behind the training thread's wait"
    assert server.get(keys.lost(2)).decode() == lost_mark(7, "exited (its launcher saw it)")


def test_the_connects_bound_is_a_few_measured_connects_and_the_whole_timeout_until_one_was() -> None:
    clock = ConnectTimeout(collective=5.0)
    assert clock.seconds() == 5.0  # a first round, or a joiner's: nothing measured
    clock.connected(0.02)
    assert clock.seconds() == FLOOR_S
    clock.connected(0.5)
    clock.connected(0.1)  # the slowest counts
    assert clock.seconds() == MARGIN * 0.5
    clock.connected(3.0)
    assert clock.seconds() == 5.0  # never past the collective timeout
    clock.failed()  # perhaps a slow store, not a lost member: the next waits the whole timeout
    assert clock.seconds() == 5.0
    clock.connected(0.01)
    assert clock.seconds() == FLOOR_S


def test_a_process_with_nothing_measured_starts_from_the_members_published_connect() -> None:
    clock = ConnectTimeout(collective=5.0)
    assert clock.fresh()
    clock.start_from(0.5)  # a joiner: the slowest connect the members published
    assert clock.seconds() == MARGIN * 0.5 and not clock.fresh()
    clock.failed()
    clock.start_from(0.01)  # after a failure the next connect waits the whole timeout, whatever was published
    assert clock.seconds() == 5.0
    assert ConnectTimeout(5.0).connected(0.2) is True  # the slowest so far: worth publishing
    measured = ConnectTimeout(5.0)
    measured.connected(0.2)
    assert measured.connected(0.1) is False


@pytest.mark.timeout(30)
def test_a_joiner_lost_member_costs_the_members_connect_bound_not_the_timeout() -> None:
    """The soak: a member lost as a round formed; the members' connects gave up after 1 s, a fresh joiner's after
    the whole 5 s, and the next round's leader, which waits for every live member, waited for it (4.0 s). A joiner
    starts from the connect the members published."""
    if not torch_private.group_timeout_settable():
        pytest.skip(f"torch {torch.__version__} cannot set a formed group's timeout: it connects with that one")
    store = dist.HashStore()
    timeouts = Timeouts(heartbeat=5.0, collective=10.0, admission=60.0)
    member = RoundGroup(store, timeouts, alarm_store=store)
    member.form(Round(1, [4], 4))  # its connect, in milliseconds, published
    member.leave()
    assert float(store.get(keys.CONNECT_SLOWEST)) < FLOOR_S
    joiner = RoundGroup(store, timeouts, alarm_store=store)
    store.add("gradsync/elastic/round2/arrived", 1)  # worker 5 reached the gate, and was lost before connecting
    began = time.monotonic()
    with pytest.raises(MembershipChanged, match="within its connect bound, 0.2s"):
        joiner.form(Round(2, [4, 5], 4))
    assert time.monotonic() - began < FLOOR_S + 1.0


@pytest.mark.timeout(30)
def test_a_member_lost_after_the_gate_opened_costs_the_connects_bound_not_the_collective_timeout() -> None:
    """The soak's one pause over 3 s that no partition caused: three kills within 0.31 s, one member lost between
    its round's gate opening and its group connecting, and the others waited the whole timeout (4.37 s at 5 s).
    The group then formed has the collective timeout, whatever bound it connected within."""
    if not torch_private.group_timeout_settable():
        pytest.skip(f"torch {torch.__version__} cannot set a formed group's timeout: it connects with that one")
    store = dist.HashStore()
    group = RoundGroup(store, Timeouts(heartbeat=5.0, collective=10.0, admission=60.0), alarm_store=store)
    try:
        group.form(Round(1, [4], 4))  # a round of one: its connect measured, in milliseconds
        group.form(Round(2, [4], 4))  # connected within FLOOR_S, then given the collective timeout
        assert torch_private.backend_timeout_seconds(dist.group.WORLD, torch.device("cpu")) == 10.0
        store.add("gradsync/elastic/round3/arrived", 1)  # worker 5 reached the gate, and was lost before connecting
        began = time.monotonic()
        with pytest.raises(MembershipChanged, match="forming round 3's group failed within its connect bound, 0.2s"):
            group.form(Round(3, [4, 5], 4))
        waited = time.monotonic() - began
        assert FLOOR_S <= waited < FLOOR_S + 1.0, f"waited {waited:.1f}s for the lost member (collective: 10 s)"
    finally:
        group.leave()


@pytest.mark.timeout(30)
def test_a_connect_failed_while_a_member_was_seen_gone_keeps_its_bound() -> None:
    """A failed connect waits the whole timeout next time, in case the store, not a member, was too slow; but one
    failed while the heartbeat thread saw a member of the round gone is explained: the soak's second member lost in
    the round after such a failure cost 5 s instead of the bound."""
    if not torch_private.group_timeout_settable():
        pytest.skip(f"torch {torch.__version__} cannot set a formed group's timeout: it connects with that one")
    store = dist.HashStore()
    group = RoundGroup(store, Timeouts(heartbeat=5.0, collective=10.0, admission=60.0), alarm_store=store)
    try:
        group.form(Round(1, [4], 4))
        for number, lost in ((2, 5), (3, 6)):  # each a member at the gate, then lost before connecting
            store.add(f"gradsync/elastic/round{number}/arrived", 1)
            seen = threading.Timer(0.05, group.tell_members, args=(lost, "exited (its launcher saw it)", 3))
            seen.start()
            began = time.monotonic()
            with pytest.raises(MembershipChanged, match="within its connect bound"):
                group.form(Round(number, [4, lost], 4))
            seen.join()
            assert time.monotonic() - began < FLOOR_S + 1.0, f"round {number} waited past its bound"
    finally:
        group.leave()
