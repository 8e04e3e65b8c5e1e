"""A recovery's record (gradsync/elastic/recovery.py): each phase's seconds, in order, and the phase a failure left;
and when an elastic worker stops recovering: not within a burst of faults, which cost the 8-host soak its last
state holder, but still when recovery cannot succeed."""

from __future__ import annotations

import time

import pytest

from gradsync.elastic.recovery import FUTILE_TIMEOUTS, MAX_FUTILE, FutileRecoveries, Phases


def test_each_phase_is_timed_in_order():
    clock = Phases()
    with clock.phase("leave"):
        time.sleep(0.05)
    with clock.phase("round"):
        pass
    seconds = clock.seconds()
    assert list(seconds) == ["leave", "round"]
    assert 0.05 <= seconds["leave"] < 1.0 and seconds["round"] < 0.05
    assert clock.failed_in is None
    assert clock.describe().startswith("leave 0.0") and ", round 0.00s" in clock.describe()


def test_a_failure_names_its_phase_and_keeps_its_time():
    clock = Phases()
    with clock.phase("leave"):
        pass
    with pytest.raises(RuntimeError), clock.phase("group"):
        time.sleep(0.02)
        raise RuntimeError("a member was lost")
    assert clock.failed_in == "group"
    assert clock.seconds()["group"] >= 0.02
    assert clock.describe().endswith("group 0.02s")


def test_the_docstring_example_runs():
    clock = Phases()
    with clock.phase("leave"):
        pass
    assert clock.seconds().keys() == {"leave"} and clock.describe() == "leave 0.00s"


def test_a_burst_of_changes_within_seconds_does_not_give_up() -> None:
    futile = FutileRecoveries(heartbeat_timeout=5.0)
    said = [futile.count(steps=6089, now=100.0 + 0.25 * i) for i in range(MAX_FUTILE + 3)]
    assert said == [None] * (MAX_FUTILE + 3)  # the soak's last holder gave up at the 6th, 1.5 s in


def test_changes_without_a_commit_for_long_give_up_and_say_so() -> None:
    futile = FutileRecoveries(heartbeat_timeout=5.0)
    for i in range(MAX_FUTILE):
        assert futile.count(steps=10, now=float(i)) is None
    assert futile.count(steps=10, now=FUTILE_TIMEOUTS * 5.0 - 0.1) is None  # past the count, not yet the time
    assert futile.count(steps=10, now=FUTILE_TIMEOUTS * 5.0) == "7 membership changes in 30s without a committed step"


def test_a_committed_step_starts_a_fresh_row() -> None:
    futile = FutileRecoveries(heartbeat_timeout=1.0)
    for i in range(MAX_FUTILE + 1):
        futile.count(steps=10, now=float(i))
    assert futile.count(steps=11, now=100.0) is None  # a step committed since: one change, not MAX_FUTILE + 2
    for i in range(MAX_FUTILE - 1):
        assert futile.count(steps=11, now=101.0 + i) is None
    assert futile.count(steps=11, now=200.0) == f"{MAX_FUTILE + 1} membership changes in 100s without a committed step"
