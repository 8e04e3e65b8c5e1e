"""When an elastic worker stops recovering (gradsync/elastic/futile.py): not within a burst of faults, which cost
the 8-host soak its last state holder, but still when recovery cannot succeed."""

from __future__ import annotations

from gradsync.elastic.futile import FUTILE_TIMEOUTS, MAX_FUTILE, FutileRecoveries


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
