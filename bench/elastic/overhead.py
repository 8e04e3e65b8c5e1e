"""What elastic training costs per step: the elastic commit against a plain ``optimizer.step()``, in one job, in
alternating blocks of 5 steps, in the namespace lab (4 hosts, or 3 for 3 ranks, at 10 Gbit/s), with prescribed
100 ms of compute per step so that 16 ranks fit on 2 cores (the ranks sleep, they do not spin). Reports, per world
size, the medians of both kinds of step (rank 0's, past the first step of each block), the overhead, and the CPU
used (headroom).

    python -m bench.elastic.overhead --ranks 3 8 16 --runs 3
    python -m bench.elastic.overhead --ranks 3 8 16 --runs 3 --source ../old-checkout   # another version
    python -m bench.elastic.overhead --ranks 3 8 --runs 3 --store etcd   # the job's store on 3 etcd members

The model to 256 ranks: the training thread makes no store operation per step, so the per-step cost is local
work, whatever N; what grows with N is the store's background load (each rank's heartbeat thread: its beat, the one
member it watches, the round's admission key: three operations every 0.1 s; measured at 256 and 1,024 ranks by
``python -m bench.store_load``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from lab import etcd_cluster, netlab

ROOT = Path(__file__).resolve().parents[2]


def _cpu_seconds() -> float:
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    user, nice, system = (int(v) for v in fields[:3])
    return (user + nice + system) / os.sysconf("SC_CLK_TCK")


def run_once(ranks: int, steps: int, compute_s: float, source: Path = ROOT, store: str = "tcp") -> dict:
    """``store``: "tcp" (h0's launcher serves it) or "etcd" (one etcd member on each of the first 3 hosts)."""
    hosts = 3 if ranks == 3 else 4
    per_host = ranks // hosts
    out = Path(tempfile.mkdtemp(prefix="gsoverhead"))
    with netlab.lab(hosts=hosts, rate="10gbit", prefix="gsoverhead") as lab, contextlib.ExitStack() as stack:
        extra = ["--rdzv-endpoint", f"{lab[0].address}:29660"]  # h0's launcher serves the job's store there
        if store == "etcd":  # the store is etcd's: no endpoint (gradsync run refuses one it would not use)
            etcd = stack.enter_context(etcd_cluster.cluster(out / "etcd", hosts=lab[:3]))
            extra = ["--store", etcd.url, "--rdzv-id", f"overhead-{out.name}"]
        procs = []
        for host in lab:
            env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "LOCAL_"))}
            env.update(GLOO_SOCKET_IFNAME=host.interface, PYTHONPATH=str(source), OMP_NUM_THREADS="1")
            env.update(STEPS=str(steps), COMPUTE_S=str(compute_s))
            argv = [sys.executable, "-m", "gradsync", "run", "--elastic", "--nnodes", str(hosts)]
            argv += ["--nproc-per-node", str(per_host), *extra]
            argv += ["--local-addr", host.address, str(ROOT / "bench" / "elastic" / "overhead_worker.py"), str(out)]
            command = host.command(["env", *[f"{k}={v}" for k, v in env.items()], *argv])
            procs.append(
                subprocess.Popen(command, cwd=source, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            )
        cpu_before, wall_before = _cpu_seconds(), time.monotonic()
        try:
            logs = [p.communicate(timeout=600)[0] for p in procs]
        finally:
            for p in procs:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGKILL)
        cpu = (_cpu_seconds() - cpu_before) / (time.monotonic() - wall_before) / os.cpu_count()
    results = [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]
    assert len(results) == ranks, "\n".join(log[-2000:] for log in logs)
    assert all(r["recoveries"] == 0 for r in results), "a membership change during the measurement"
    rank0 = results[0]
    elastic_s = statistics.median(rank0["elastic"][4:])  # past the first block (group warm-up)
    plain_s = statistics.median(rank0["plain"])
    return {"elastic_ms": elastic_s * 1e3, "plain_ms": plain_s * 1e3, "cpu": cpu}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.elastic.overhead", description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[3, 8, 16])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--compute", type=float, default=0.1, help="prescribed compute per step, seconds")
    parser.add_argument("--source", type=Path, default=ROOT, help="the gradsync checkout to run (before/after)")
    parser.add_argument("--store", choices=("tcp", "etcd"), default="tcp", help="where the job's store lives")
    args = parser.parse_args(argv)
    if netlab.available() is not None:
        print(f"skipped: {netlab.available()}")
        return 1
    print("| ranks | elastic step (ms) | plain step (ms) | overhead (ms) | overhead | CPU used |")
    print("|---:|---:|---:|---:|---:|---:|")
    for ranks in args.ranks:
        rows = [run_once(ranks, args.steps, args.compute, args.source.resolve(), args.store) for _ in range(args.runs)]
        overheads = [r["elastic_ms"] - r["plain_ms"] for r in rows]
        med = statistics.median
        print(
            f"| {ranks} | {med(r['elastic_ms'] for r in rows):.2f} | {med(r['plain_ms'] for r in rows):.2f} | "
            f"{med(overheads):+.2f} ({', '.join(f'{o:+.2f}' for o in overheads)}) | "
            f"{med(overheads) / med(r['plain_ms'] for r in rows):+.1%} | {med(r['cpu'] for r in rows):.0%} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
