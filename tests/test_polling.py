"""gradsync.polling.wait_until: the one polling wait, with a deadline and a growing pause."""

from __future__ import annotations

import time

import pytest

from gradsync.polling import wait_until


def test_wait_until_returns_at_once_when_true_and_false_at_the_deadline() -> None:
    calls: list[float] = []
    assert wait_until(lambda: calls.append(time.monotonic()) is None, seconds=5)  # True on the first call
    assert len(calls) == 1
    calls.clear()
    start = time.monotonic()
    assert not wait_until(lambda: bool(calls.append(time.monotonic())), seconds=0.5, pause=0.01, max_pause=0.1)
    elapsed = time.monotonic() - start
    assert 0.5 <= elapsed < 0.8
    assert 5 <= len(calls) <= 12  # 0.01, 0.02, 0.04, 0.08, then 0.1 each: no spinning


def test_a_condition_that_raises_ends_the_wait_with_its_error() -> None:
    def lost() -> bool:
        raise RuntimeError("member 2 exited")

    with pytest.raises(RuntimeError, match="member 2 exited"):
        wait_until(lost, seconds=5)
