"""Many simulated ranks in one process: each is the library's own ``Membership`` (its heartbeat thread, the ring
watch, the admission look, the round agreement) on clients of its own, so the requests are the code's, at its
intervals; only the training (and the gloo group, whose full mesh 1,024 ranks cannot open on one machine) is
left out. Every operation goes through a ``RecordingStore``; what a host of ranks sends back is a summary.

One launcher per ``RANKS_PER_NODE`` ranks looks at the job as ``gradsync run --elastic``'s does
(``gradsync.launch.elastic.Job``, about once a second)."""

from __future__ import annotations

import threading
import time
from array import array
from collections import Counter
from dataclasses import dataclass, field

from bench.store_load.pattern import largest_gap, steady_pattern
from bench.store_load.recording import Op, RecordingStore
from gradsync.elastic.membership import Membership
from gradsync.elastic.timeouts import Timeouts
from gradsync.elastic.verdicts import mark_exited
from gradsync.launch.elastic import Job
from gradsync.store import job_store
from gradsync.store.etcd_client import EtcdClient

RANKS_PER_NODE = 8
STEP_S = 0.1  # a training step's time (only its boundary is simulated)
TIMEOUTS = Timeouts(heartbeat=10.0, collective=10.0, admission=600.0)  # gradsync.elastic.init's defaults


@dataclass
class Plan:
    """What every host of ranks does, when: ``total`` ranks; the steady window's length; ``lose``: the member
    (its number) lost after it, its exit reported by its launcher, as a killed worker's is."""

    where: str
    total: int
    steady_s: float
    lose: int


@dataclass
class HostSummary:
    """What one host of simulated ranks measured; ``latencies``: every operation's seconds in the steady window."""

    ranks: int
    first_round_s: float = 0.0
    regroup_s: float = 0.0
    round2_sizes: list[int] = field(default_factory=list)
    regroup_errors: list[str] = field(default_factory=list)
    window: tuple[float, float] = (0.0, 0.0)
    ops: Counter = field(default_factory=Counter)
    http: int = 0
    latencies: bytes = b""
    patterns: Counter = field(default_factory=Counter)
    periods: list[float] = field(default_factory=list)
    largest_gap_s: float = 0.0
    cpu_s: float = 0.0


_http_calls = [0]


def _count_http() -> None:
    """Count the etcd client's requests (each store operation is one or more)."""
    call = EtcdClient.call

    def counted(self: EtcdClient, path: str, body: dict) -> dict:
        _http_calls[0] += 1
        return call(self, path, body)

    EtcdClient.call = counted  # type: ignore[method-assign]


def _ranks(where: str, count: int) -> list[tuple[Membership, list[Op]]]:
    made = []
    for _ in range(count):
        ops: list[Op] = []
        store, beat = (RecordingStore(s, ops) for s in job_store.open_stores(where, 2))
        made.append((Membership(store, beat, TIMEOUTS, where), ops))
    return made


def _in_threads(calls: list) -> list:  # noqa: ANN001
    results: list = [None] * len(calls)

    def run(i: int) -> None:
        results[i] = calls[i]()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def _launchers(where: str, count: int, stop: threading.Event, ops: list[Op]) -> list[threading.Thread]:
    """Each launcher's client (a short timeout, as the launcher's), connected before its ranks, as it is."""
    jobs = [Job(RecordingStore(job_store.open_store(where, timeout=5.0), ops), where, False) for _ in range(count)]

    def look(job: Job) -> None:
        while not stop.wait(0.2):  # gradsync run --elastic's loop
            job.look()

    threads = [threading.Thread(target=look, args=(job,), daemon=True) for job in jobs]
    for t in threads:
        t.start()
    return threads


def host(plan: Plan, count: int, barrier, loss_at, out) -> None:  # noqa: ANN001 - multiprocessing objects
    """One host of ``count`` simulated ranks: arrive, form round 1, beat for the steady window, lose
    ``plan.lose`` (if it is here) and regroup; sends a ``HostSummary`` through ``out``."""
    _count_http()
    summary = HostSummary(count)
    stop, launcher_ops = threading.Event(), []
    _launchers(plan.where, max(1, count // RANKS_PER_NODE), stop, launcher_ops)
    ranks = _ranks(plan.where, count)
    barrier.wait()
    began = time.monotonic()
    _in_threads([lambda m=m: m.first_round(plan.total) for m, _ in ranks])
    summary.first_round_s = time.monotonic() - began
    barrier.wait()
    summary.window, cpu, http = _steady(plan, ranks)
    barrier.wait()
    _regroup(plan, summary, ranks, loss_at)
    stop.set()
    for m, _ in ranks:
        m.stop()
    _summarise(summary, ranks, launcher_ops, cpu, http)
    out.send(summary)


def _steady(plan: Plan, ranks: list) -> tuple[tuple[float, float], float, int]:
    """Training steps of ``STEP_S``: each rank's step boundary (no store operation: it lets rank 0's heartbeat
    thread look for join requests, as a training rank's does once it knows its step time)."""
    start, cpu, http = time.monotonic(), time.process_time(), _http_calls[0]
    step = 0
    while time.monotonic() < start + plan.steady_s:
        step += 1
        for m, _ in ranks:
            m.step_boundary(step)
        time.sleep(STEP_S)
    return (start, time.monotonic()), time.process_time() - cpu, _http_calls[0] - http


def _regroup(plan: Plan, summary: HostSummary, ranks: list, loss_at) -> None:  # noqa: ANN001
    while loss_at.value == 0.0:
        time.sleep(0.01)
    time.sleep(max(0.0, loss_at.value - time.monotonic()))
    survivors = []
    for m, _ in ranks:
        if m.me == plan.lose:
            m.stop()  # its heartbeat stops, and its launcher reports the exit
            mark_exited(m.store, m.me)
        else:
            survivors.append(m)
    rounds = _in_threads([lambda m=m: _next_round(m) for m in survivors])
    summary.regroup_s = time.monotonic() - loss_at.value
    summary.round2_sizes = sorted({r.world_size for r in rounds if not isinstance(r, str)})
    summary.regroup_errors = sorted({r for r in rounds if isinstance(r, str)})


def _next_round(member: Membership) -> object:
    """The member's next round, or why it failed (a member whose round failed reports it, as a survivor would)."""
    try:
        return member.next_round(steps=100)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


def _summarise(summary: HostSummary, ranks: list, launcher_ops: list[Op], cpu: float, http: int) -> None:
    start, end = summary.window
    latencies = array("f")
    for ops in [o for _, o in ranks] + [launcher_ops]:
        for op in ops:
            if start <= op.start < end:
                summary.ops[op.name] += 1
                latencies.append(op.seconds)
    summary.latencies = latencies.tobytes()
    summary.cpu_s, summary.http = cpu, http
    for m, ops in ranks:
        steady = [op for op in ops if start <= op.start < end]
        pattern, period = steady_pattern(steady, m.me)
        summary.patterns[pattern] += 1
        summary.periods.append(period)
        summary.largest_gap_s = max(summary.largest_gap_s, largest_gap(steady, m.me))
