"""The job's store under many ranks, measured: ``python -m bench.store_load --ranks 256 1024 --store tcp etcd``.

First a real 3-rank elastic job (``gradsync run --elastic``) is run with every store operation recorded
(``record_worker.py``), one rank lost at step 40. Then, per store and world size, the simulated ranks
(``sim.py``: the library's own ``Membership`` each, spread over ``--hosts`` processes) arrive, form round 1, beat
for ``--seconds``, lose one member and regroup. Before any figure is reported, each simulated rank's heartbeat
(its operations and period, ``pattern.py``) is checked equal to the recorded real rank's.

Reported: store operations and HTTP requests per second in the steady window, their p50/p99 latency, the longest
gap between two beats of any rank (against the heartbeat timeout, 10 s), the times to form round 1 and to regroup
after the loss, the store's CPU (cores) and the simulated ranks' own, and the machine's CPU busy (above 80%
the figure measured the machine more than the store)."""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from array import array
from collections import Counter
from pathlib import Path

from bench.store_load import servers, sim
from bench.store_load.pattern import steady_pattern
from bench.store_load.recording import Op
from gradsync.elastic.liveness import HEARTBEAT_S, beat_interval
from lab import netlab, results

ROOT = Path(__file__).resolve().parents[2]


def record_real(out: Path) -> dict[tuple[str, ...], int]:
    """A real 3-rank job's heartbeat patterns (how many of its ranks beat each), and their period."""
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT), LOSE_AT="40", STEPS="80")
    argv = [sys.executable, "-m", "gradsync", "run", "--elastic", "--nnodes", "1", "--nproc-per-node", "3"]
    argv += ["--max-restarts", "0", str(ROOT / "bench/store_load/record_worker.py"), str(out)]
    subprocess.run(argv, env=env, capture_output=True, timeout=180, check=False)
    patterns: Counter = Counter()
    for path in sorted(out.glob("*.json")):
        recorded = json.loads(path.read_text())
        pattern, period = steady_pattern([Op(*op) for op in recorded["ops"]], recorded["me"])
        patterns[pattern] += 1
        if abs(period - HEARTBEAT_S) > 0.02:
            raise SystemExit(f"the real rank {recorded['me']} beat every {period:.3f}s, not {HEARTBEAT_S}s")
    if len(patterns) != 2:
        raise SystemExit(f"the real job's ranks beat {len(patterns)} ways, not 2 (rank 0's, the others'): {patterns}")
    return patterns


def _machine_busy() -> tuple[float, float]:
    """(busy, total) jiffies of the machine so far."""
    fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]
    return sum(fields) - idle, sum(fields)


def _hosts_of(ranks: int, hosts: int) -> list[int]:
    return [ranks // hosts + (1 if i < ranks % hosts else 0) for i in range(hosts)]


def run_one(
    kind: str, ranks: int, hosts: int, seconds: float, work: Path, phase_s: float
) -> tuple[dict, list[sim.HostSummary]]:
    """One world size on one store: the simulated ranks' summaries, and the store's and the machine's CPU; or,
    where a phase (the arrival, round 1, the steady window) took over ``phase_s``, which one (``failed``)."""
    ctx = multiprocessing.get_context("fork")
    served_by = servers.tcp_store() if kind == "tcp" else servers.etcd(work / f"etcd-{ranks}")
    with served_by as served:
        plan = sim.Plan(served.where, ranks, seconds, lose=ranks)
        barrier, loss_at = ctx.Barrier(hosts + 1, timeout=phase_s), ctx.Value("d", 0.0)
        pipes, processes = [], []
        for count in _hosts_of(ranks, hosts):
            receive, send = ctx.Pipe(duplex=False)
            processes.append(ctx.Process(target=sim.host, args=(plan, count, barrier, loss_at, send), daemon=True))
            processes[-1].start()
            pipes.append(receive)
        cpu, busy, began = served.cpu_seconds(), _machine_busy(), time.monotonic()
        try:
            phase = "every rank to arrive"
            barrier.wait()
            phase = "round 1 to form"
            barrier.wait()
            cpu, busy, began = served.cpu_seconds(), _machine_busy(), time.monotonic()
            phase = "the steady window to end"
            barrier.wait()
        except threading.BrokenBarrierError:
            for process in processes:
                process.kill()
            wall = time.monotonic() - began
            cores = (served.cpu_seconds() - cpu) / wall
            return {"failed": f"waited {phase_s:.0f}s for {phase}", "store_cores": cores}, []
        wall = time.monotonic() - began
        machine = [b - a for a, b in zip(busy, _machine_busy())]
        measured = {"store_cores": (served.cpu_seconds() - cpu) / wall, "machine_busy": machine[0] / machine[1]}
        loss_at.value = time.monotonic() + 0.5
        summaries = [pipe.recv() for pipe in pipes if pipe.poll(600)]
        for process in processes:
            process.join(30)
    if len(summaries) != hosts:
        raise SystemExit(f"{kind}, {ranks} ranks: {hosts - len(summaries)} of {hosts} hosts sent no summary")
    return measured, summaries


def figures(kind: str, ranks: int, measured: dict, summaries: list[sim.HostSummary], real: Counter) -> dict:
    """The row of one run, after checking that the simulated ranks beat as the real one did."""
    patterns = sum((s.patterns for s in summaries), Counter())
    if set(patterns) != set(real) or patterns[max(real, key=len)] != 1:
        raise SystemExit(
            f"{kind}, {ranks} ranks: the simulated ranks' heartbeats {dict(patterns)} are not the real "
            f"job's {dict(real)} (one rank 0, every other rank alike)"
        )
    period = statistics.median(p for s in summaries for p in s.periods)
    window = statistics.median(s.window[1] - s.window[0] for s in summaries)
    latencies = array("f")
    for s in summaries:
        latencies.frombytes(s.latencies)
    ordered = sorted(latencies)
    sizes = {size for s in summaries for size in s.round2_sizes}
    return {
        "store": kind,
        "ranks": ranks,
        "ops_per_s": sum(sum(s.ops.values()) for s in summaries) / window,
        "http_per_s": sum(s.http for s in summaries) / window if kind == "etcd" else None,
        "p50_ms": 1e3 * ordered[len(ordered) // 2],
        "p99_ms": 1e3 * ordered[int(len(ordered) * 0.99)],
        "beat_period_s": period,  # longer than the intended one where the store answers too slowly
        "intended_beat_s": beat_interval(ranks, sim.TIMEOUTS.heartbeat),
        "largest_beat_gap_s": max(s.largest_gap_s for s in summaries),
        "heartbeat_timeout_s": sim.TIMEOUTS.heartbeat,
        "first_round_s": max(s.first_round_s for s in summaries),
        "regroup_s": max(s.regroup_s for s in summaries),
        "regroup_ok": sizes == {ranks - 1},
        "regroup_errors": sorted({e for s in summaries for e in s.regroup_errors}),
        "sim_cores": sum(s.cpu_s for s in summaries) / window,
        **measured,
    }


def in_a_namespace(argv: list[str]) -> int:
    """Run this benchmark again inside a network namespace with its loopback only. torch's c10d sockets name each
    peer with a reverse lookup (getnameinfo, in ``c10d::detail::formatSockAddr``, on a client's connect and on the
    libuv server's one thread): where the resolver does not answer, as this machine's, some connections wait 5 s
    for it. In a namespace with no route to the resolver the lookup fails at once, as on a cluster whose resolver
    answers (docs/scaling.md)."""
    with netlab.lab(hosts=1, rate=None, prefix="gsload") as hosts:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        command = hosts[0].command([sys.executable, "-m", "bench.store_load", *argv, "--inside"])
        return subprocess.run(command, env=env, check=False).returncode


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--store", nargs="+", choices=["tcp", "etcd"], default=["tcp", "etcd"])
    p.add_argument("--hosts", type=int, default=8, help="processes the simulated ranks are spread over")
    p.add_argument("--seconds", type=float, default=20.0, help="the steady window")
    p.add_argument("--out", type=Path, default=ROOT / "bench/results/store_load.json")
    p.add_argument(
        "--phase-timeout", type=float, default=300.0, help="seconds a phase may take before it counts as failed"
    )
    p.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)  # already in its namespace
    args = p.parse_args()
    if not args.inside:
        raise SystemExit(in_a_namespace(sys.argv[1:]))
    work = Path(tempfile.mkdtemp(prefix="gsstoreload"))
    real = record_real(work / "record")
    print(f"the real job's heartbeats: {dict(real)}", flush=True)
    rows = []
    for kind in args.store:
        for ranks in args.ranks:
            measured, summaries = run_one(kind, ranks, args.hosts, args.seconds, work, args.phase_timeout)
            failed = "failed" in measured
            rows.append(
                {"store": kind, "ranks": ranks, **measured}
                if failed
                else figures(kind, ranks, measured, summaries, real)
            )
            print(json.dumps(rows[-1]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    results.write_json(args.out, {"real_heartbeats": [list(k) for k in real], "rows": rows})


if __name__ == "__main__":
    main()
