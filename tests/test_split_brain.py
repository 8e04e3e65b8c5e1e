"""Split brain (issue 40 part 5): of 5 hosts, h3 and h4 are cut off together from h0-h2 (h0 serves the job's store)
for longer than the heartbeat timeout, their processes running and reaching each other. The minority must never
commit a step of its own, and when the partition heals it rejoins the majority's state: one history, one set of
parameters, every sample used once."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from lab import netlab  # noqa: E402
from lab.elastic import (  # noqa: E402
    check_exactly_once,
    events_of,
    finals,
    finish,
    kill_all,
    launch,
    pid_of,
    recoveries,
    wait_steps,
)

HOSTS, EPOCHS = 5, 12
MINORITY = {3, 4}
CUT_S = 8.0  # past the heartbeat timeout (5 s): the majority leaves the minority out and trains on


def steps_by_host(events: list[dict], host_of: dict[int, str]) -> dict[tuple, set[str]]:
    """Each committed step (epoch, position, world, step) and the hosts whose workers recorded it."""
    recorded: dict[tuple, set[str]] = {}
    for e in events:
        recorded.setdefault((e["epoch"], e["position"], e["world"], e["step"]), set()).add(host_of[e["pid"]])
    return recorded


@pytest.mark.long
@pytest.mark.netlab()
@pytest.mark.timeout(300)
def test_a_partitioned_minority_commits_nothing_of_its_own_and_rejoins_the_majority(tmp_path: Path) -> None:
    out = tmp_path / "split"
    out.mkdir()
    minority = {f"h{k}" for k in MINORITY}
    with netlab.lab(hosts=HOSTS, rate="1gbit", prefix="gssplit") as lab:
        variables = {"STEP_SLEEP": "0.05", "ELASTIC_TIMEOUT": "5", "EPOCHS": str(EPOCHS)}
        procs = launch(lab, out, variables)
        try:
            wait_steps(out, 15)
            cut_off = {pid_of(out, host) for host in minority}
            cut = time.time()
            with netlab.partition(lab, MINORITY):
                time.sleep(CUT_S)
            healed = time.time()
            logs = finish(procs)
        finally:
            kill_all(procs, out)
    events, host_of = events_of(out), {int(p.stem): p.read_text() for p in out.glob("*.pid")}
    recorded = steps_by_host(events, host_of)
    own = sorted(step for step, hosts in recorded.items() if hosts <= minority)
    assert not own, f"the cut-off minority committed steps of its own (epoch, position, world, step): {own[:5]}"
    majority_alone = [e for e in events if cut < e["t"] < healed and e["world"] == HOSTS - len(MINORITY)]
    assert majority_alone, "the majority did not train on without the minority during the partition"
    assert not [e for e in events if cut + 1.0 < e["t"] < healed and e["pid"] in cut_off], "the minority trained"
    rejoined = {host_of[e["pid"]] for e in events if e["t"] > healed and e["world"] == HOSTS}
    assert minority <= rejoined, f"after the partition healed only {sorted(rejoined)} trained in the whole world"
    # Each cut-off worker finds itself left out and asks to join again, in-process: none fails (a rejoiner once
    # crashed at an epoch's end, given an empty batch: tests/test_elastic.py's loader tests).
    restarts = [line for log in logs for line in log.splitlines() if "exited with" in line]
    assert not restarts, "\n".join(restarts) + "\n" + recoveries(logs)
    ended = finals(out)
    assert len(ended) == HOSTS and len({round(f["checksum"], 9) for f in ended}) == 1, ended
    check_exactly_once(out, EPOCHS, killed=len(MINORITY), hosts=HOSTS)
