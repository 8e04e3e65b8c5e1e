"""A straggler is kept and named (gradsync/elastic/pace.py): each member posts its share of time outside
collectives, and the round's rank 0 says, once while it lasts, which member the others wait on."""

from __future__ import annotations

import logging
import time

import pytest
import torch.distributed as dist

from gradsync.collectives.activity import CollectiveActivity
from gradsync.elastic import keys, pace
from gradsync.elastic.pace import Pace, straggler
from gradsync.elastic.rounds import Round


def test_the_straggler_is_the_member_busy_while_the_others_wait() -> None:
    assert straggler({1: 0.34, 2: 0.98, 3: 0.31, 4: 0.36}) == 2
    assert straggler({1: 0.95, 2: 0.97, 3: 0.93}) is None  # an even pace, however busy
    assert straggler({1: 0.72, 2: 0.93, 3: 0.70}) is None  # slower by a little: not worth a word
    assert straggler({1: 0.3, 2: 0.99}) == 2 and straggler({1: 0.99}) is None


@pytest.mark.parametrize("members", [[1, 2, 3], [1, 2, 3, 4]], ids=["all posted", "a joiner not yet"])
def test_rank_0_names_the_straggler_once_while_it_lasts(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, members: list[int]
) -> None:
    monkeypatch.setattr(pace, "PACE_S", 0.05)
    store = dist.HashStore()
    activities = {m: CollectiveActivity() for m in (1, 2, 3)}
    for member in (1, 3):
        activities[member].enter()  # waiting inside the all-reduce for member 2
    paces = {m: Pace(m, a) for m, a in activities.items()}
    with caplog.at_level(logging.WARNING, logger="gradsync"):
        for _ in range(3):  # three windows, the straggler the same in each
            time.sleep(0.06)
            for member in (2, 3, 1):  # rank 0 (member 1) last: it reads the others' shares
                paces[member].look(store, Round(1, members, member))  # member 4, a joiner, posts nothing yet
    named = [r.getMessage() for r in caplog.records if "sets the job's pace" in r.getMessage()]
    assert len(named) == 1 and "worker 2 (rank 1) sets the job's pace" in named[0], named
    assert float(store.get(keys.pace(2))) > 0.9 and float(store.get(keys.pace(1))) < 0.1
