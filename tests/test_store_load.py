"""What the elastic protocol asks of the job's store, as N grows: a member's requests per beat and per round stay
flat, the job's beats a second stop growing past 100 members, and the store benchmark (bench/store_load) checks
its simulated ranks against a recorded real one before it reports anything (docs/scaling.md)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import torch.distributed as dist

from bench.store_load.pattern import beats, steady_pattern, template
from bench.store_load.recording import Op, RecordingStore
from gradsync.elastic import keys
from gradsync.elastic.liveness import BEATS_PER_S, HEARTBEAT_S, Liveness, beat_interval
from gradsync.elastic.membership import Membership
from gradsync.elastic.timeouts import Timeouts
from gradsync.elastic.training_view import Admission
from gradsync.elastic.verdicts import mark_exited
from lab import certs, etcd_cluster

ROOT = Path(__file__).resolve().parents[1]


def test_keys_are_templated_by_whose_they_are() -> None:
    assert template("gradsync/elastic/beat/3", me=3) == "beat/<me>"
    assert template("gradsync/elastic/beat/4", me=3) == "beat/<peer>"
    assert template("gradsync/elastic/round12/admit_at", me=3) == "round<k>/admit_at"
    assert template("gradsync/elastic/join_requests", me=3) == "join_requests"


def _op(start: float, name: str, key: str, thread: str = "gradsync-heartbeat") -> Op:
    return Op(start, 0.0, thread, name, key)


def test_a_beat_is_the_heartbeat_threads_operations_from_one_beat_of_its_own_to_the_next() -> None:
    ops = [
        _op(0.0, "set", "gradsync/elastic/beat/1"),
        _op(0.01, "add", "gradsync/elastic/beat/2"),
        _op(0.02, "check", "gradsync/elastic/round1/members", thread="MainThread"),  # not the heartbeat's
        _op(0.25, "set", "gradsync/elastic/beat/1"),
        _op(0.26, "add", "gradsync/elastic/beat/2"),
        _op(0.50, "set", "gradsync/elastic/beat/1"),
        _op(0.51, "add", "gradsync/elastic/beat/2"),
        _op(0.52, "check", "gradsync/elastic/round1/admit_at"),  # a drift the comparison must see
    ]
    assert [names for _, names in beats(ops, 1)][:2] == [("set beat/<me>", "add beat/<peer>")] * 2
    pattern, period = steady_pattern(ops, 1)
    assert pattern == ("set beat/<me>", "add beat/<peer>") and period == pytest.approx(0.25)
    assert Counter(names for _, names in beats(ops, 1))[pattern] == 2  # the third beat differs, and is counted so


def test_the_jobs_beats_a_second_stop_growing_past_100_members() -> None:
    assert beat_interval(3, 10.0) == beat_interval(100, 10.0) == HEARTBEAT_S  # as every figure at 3 to 16 ranks
    assert beat_interval(256, 10.0) == 0.256  # as docs/scaling.md measured the store at 256 and 1,024
    for members in (256, 1024, 2000):  # past 2,000 the timeout caps the interval
        assert members / beat_interval(members, 10.0) <= BEATS_PER_S + 1e-9
    assert beat_interval(10**6, 10.0) == 2.0  # a watcher still reads its member five times within the timeout
    assert beat_interval(1024, 0.2) == HEARTBEAT_S  # never faster than the base, whatever the timeout
    # the admission is announced two beats ahead of the round's beat, not of the base one
    admission = Admission(beat_s=beat_interval(1024, 10.0), step_seconds=0.1)
    assert admission.steps_ahead() == 2 + 21


def test_a_watcher_reads_one_key_a_beat_and_learns_an_exit_from_it() -> None:
    """The watched member's counter is all a watcher reads: a launcher's exit report writes -1 into it."""
    store = dist.HashStore()
    ops: list[Op] = []
    liveness = Liveness(RecordingStore(store, ops), me=1, timeout=5.0)
    try:
        liveness.watch_only([1, 2])
        store.set(keys.beat(2), "7")
        time.sleep(3 * HEARTBEAT_S)
        assert liveness.alive(2)
        mark_exited(store, 2)
        time.sleep(2 * HEARTBEAT_S)
        assert not liveness.alive(2) and liveness.still_for(2) == float("inf")
    finally:
        liveness.stop()
    pattern, _ = steady_pattern(ops, 1)
    assert pattern == ("set beat/<me>", "add beat/<peer>")


@pytest.mark.timeout(60)
def test_a_member_waiting_for_its_round_costs_the_store_a_few_requests_however_long_the_wait() -> None:
    """The members wait for the round's list in the store (a TCPStore answers when it is set); polling it every
    20 ms cost 50 requests a second a member, and at 1,024 members kept the leader from deciding in time."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    timeouts = Timeouts(heartbeat=5.0, collective=5.0, admission=30.0)
    recorded: list[list[Op]] = []
    members = []
    for _ in range(5):
        ops: list[Op] = []
        client, beat = (dist.TCPStore("127.0.0.1", server.port, is_master=False) for _ in range(2))
        members.append(Membership(RecordingStore(client, ops), beat, timeouts))
        recorded.append(ops)
    try:
        _in_threads([lambda m=m: m.first_round(5, 20) for m in members])
        late = members[-1]
        mark_exited(server, members[-2].me)  # one lost; one live member comes 1 s late: everyone waits for it
        members[-2].stop()
        began = time.monotonic()
        calls = [lambda m=m: m.next_round(steps=1) for m in members[:-2]]
        calls.append(lambda: (time.sleep(1.0), late.next_round(steps=1))[1])
        rounds = _in_threads(calls)
        assert {r.world_size for r in rounds} == {4} and time.monotonic() - began >= 1.0
        during = [[op for op in ops if op.start >= began] for ops in recorded[:-2]]
        # The leader writes the list with compare_set (a member may have abandoned the round first).
        writes = ("set", "compare_set")
        waiting = [ops for ops in during if not any(op.name in writes and op.key.endswith("/members") for op in ops)]
        assert len(waiting) == len(during) - 1  # all but the round's leader
        assert max(len(ops) for ops in waiting) <= 10, [Counter(op.name for op in ops) for ops in waiting]
    finally:
        for m in members:
            m.stop()


def _in_threads(calls: list) -> list:  # noqa: ANN001
    results: list = [None] * len(calls)
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, calls[i]())) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return results


@pytest.mark.long
@pytest.mark.netlab(rate=False)
@pytest.mark.timeout(180)
def test_the_store_benchmark_checks_its_ranks_against_a_real_one_and_reports(tmp_path: Path) -> None:
    out = tmp_path / "load.json"
    argv = [sys.executable, "-m", "bench.store_load", "--ranks", "12", "--store", "tcp", "--hosts", "2"]
    done = subprocess.run([*argv, "--seconds", "2", "--out", str(out)], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["ranks"] == 12 and row["regroup_ok"] and not row["regroup_errors"]
    assert row["largest_beat_gap_s"] < row["heartbeat_timeout_s"] and row["ops_per_s"] > 0
    assert "the real job's heartbeats" in done.stdout


@pytest.mark.skipif(
    (etcd_cluster.available() or certs.available()) is not None,
    reason=str(etcd_cluster.available() or certs.available()),
)
@pytest.mark.long
@pytest.mark.timeout(180)
def test_the_request_cost_benchmark_checks_its_mechanisms_and_reports(tmp_path: Path) -> None:
    """bench/store_load/request_cost.py: puts moved etcd's revision, keep-alives did not and renewed their lease,
    the secured cluster refused a client without a user, before any figure is written."""
    out = tmp_path / "cost.json"
    argv = [sys.executable, "-m", "bench.store_load.request_cost", "--rate", "200", "--seconds", "1", "--runs", "1"]
    done = subprocess.run([*argv, "--out", str(out)], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    rows = json.loads(out.read_text())["summary"]
    assert {(r["cluster"], r["request"]) for r in rows} == {
        ("plain http", "put"),
        ("plain http", "range"),
        ("plain http", "lease keep-alive"),
        ("TLS, client certificates, a user", "put"),
        ("TLS, client certificates, a user", "range"),
        ("TLS, client certificates, a user", "lease keep-alive"),
        ("TLS, client certificates, a user", "authenticate"),
    }
    assert all(r["cpu_ms_per_request"] > 0 and r["rate"] > 0 for r in rows)
