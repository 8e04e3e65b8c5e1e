"""A recovery's phases: each one's seconds, in order, and the phase a failure left (gradsync/elastic/phases.py)."""

import time

import pytest

from gradsync.elastic.phases import Phases


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
