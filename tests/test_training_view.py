"""TrainingView: the one record the heartbeat thread reads of the training thread (elastic/training_view.py)."""

from __future__ import annotations

import sys
import threading

from gradsync.elastic.training_view import Round, TrainingView


def _entered(view: TrainingView, number: int, members: list[int] = [1, 2], me: int = 1) -> Round:  # noqa: B006
    round_ = Round(number, members, me)
    view.entered(round_, requests=0, beat_s=0.5)
    return round_


def test_the_leader_and_the_forming_round_are_seen_only_while_the_training_thread_waits() -> None:
    view = TrainingView()
    round_ = _entered(view, 2)
    with view.waiting_for(3, leader=2):
        assert view.seen().leader == (3, 2)
    assert view.seen().leader is None
    with view.forming(round_):
        assert view.seen().forming == round_ and view.seen().formed is None
    view.formed(round_)
    assert view.seen().forming is None and view.seen().formed == round_


def test_an_announcement_admits_at_its_step_in_its_own_round_only() -> None:
    view = TrainingView()
    _entered(view, 2)
    assert view.committed(5) is None
    view.announce(1, 9)  # a late read of an earlier round's key
    assert view.committed(6) is None
    view.announce(2, 9)
    assert view.committed(7) == 9
    _entered(view, 3)  # a new round starts with no announcement
    assert view.committed(10) is None


def test_a_member_lost_while_a_round_formed_counts_for_that_round_alone() -> None:
    view = TrainingView()
    view.lost_while_forming(4)
    assert view.was_lost_while_forming(4) and not view.was_lost_while_forming(5)


def test_a_snapshot_never_mixes_two_rounds_however_often_the_threads_switch() -> None:
    """The heartbeat thread's read of the round and its admission is one object: with the interpreter switching
    threads as often as it can, an announcement read for round n is never attached to another round, and every
    snapshot's admission is the one entered with its round."""
    view, stop, bad = TrainingView(), threading.Event(), []

    def beat() -> None:
        while not stop.is_set():
            seen = view.seen()
            if seen.round is None or seen.admission is None:
                continue
            if seen.admission.requests != seen.round.number:
                bad.append((seen.round.number, seen.admission.requests))
            view.announce(seen.round.number, 1000 + seen.round.number)

    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    thread = threading.Thread(target=beat, daemon=True)
    try:
        thread.start()
        for number in range(1, 10000):
            view.entered(Round(number, [1, 2], 1), requests=number, beat_s=0.5)
            at = view.committed(number)
            assert at is None or at == 1000 + number, (number, at)
    finally:
        stop.set()
        thread.join(5)
        sys.setswitchinterval(before)
    assert not bad, bad[:5]
