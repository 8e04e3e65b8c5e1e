"""What an all-reduce costs on the lab's links, as gloo runs it, so the planner is fed measured, not nominal, numbers.

Four ranks on two hosts (two per host, as every multi-host point of bench/scale.py runs them: the ring crosses the
hosts' links and keeps the local hop) time all-reduces of two sizes, the model's gradients and a quarter of them,
alternated, several times each. The planner's ring cost, ``2 (N-1) a + 2 (N-1) / N * S / B``, is a line in ``S``:
its slope gives the per-hop bandwidth ``B`` and its intercept the per-hop latency ``a``. The difference of two
sizes also cancels what a single transfer gets for free (tbf lets its 125 kB burst through at once). An earlier
probe between two hosts with one rank each read the sustained rate 7-14% low, with ±7% between runs.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench import netlab
from bench.ranks import wait_ranks

ROOT = Path(__file__).resolve().parents[1]
HOSTS, RANKS_PER_HOST = 2, 2
SMALL_FRACTION = 4  # the small size is the gradients' size divided by this (both sizes above tbf's burst)
REPEATS = 5


def probe_ring(rate: str, delay: str | None, nbytes: int, timeout: float = 300) -> tuple[float, float]:
    """(per-hop latency in s, per-hop bandwidth in bytes/s) of the lab's links at ``rate``, from all-reduces of
    ``nbytes`` and ``nbytes / SMALL_FRACTION`` on 4 ranks over 2 hosts."""
    out = Path(tempfile.mkstemp(suffix=".json")[1])
    ranks = HOSTS * RANKS_PER_HOST
    base = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "LOCAL_"))}
    base.update({"WORLD_SIZE": str(ranks), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    with netlab.lab(hosts=HOSTS, rate=rate, delay=delay, prefix="gsprobe") as hosts:
        procs = []
        for rank in range(ranks):
            host = hosts[rank // RANKS_PER_HOST]
            env = dict(base, RANK=str(rank), MASTER_ADDR=hosts[0].address, MASTER_PORT="29512")
            env["GLOO_SOCKET_IFNAME"] = host.interface
            argv = [sys.executable, "-m", "bench.scale_probe", str(out), str(nbytes)]
            procs.append(
                subprocess.Popen(host.command(["env", *[f"{k}={v}" for k, v in env.items()], *argv]), cwd=ROOT)
            )
        wait_ranks(procs, timeout, "bench.scale_probe")
    seconds = {int(size): s for size, s in json.loads(out.read_text()).items()}
    out.unlink()
    return fit_ring(seconds, ranks)


def fit_ring(seconds: dict[int, float], ranks: int) -> tuple[float, float]:
    """Per-hop (latency, bandwidth) from the all-reduce time of two sizes on a ring of ``ranks``.

    >>> fit_ring({1000: 2 * 3 * 1e-4 + 1.5 * 1000 / 1e6, 8000: 2 * 3 * 1e-4 + 1.5 * 8000 / 1e6}, 4)
    (0.0001, 1000000.0)
    """
    (small, t_small), (large, t_large) = sorted(seconds.items())
    slope = (t_large - t_small) / (large - small)  # seconds per byte: 2 (N-1) / (N B)
    steps = 2 * (ranks - 1)
    bandwidth = steps / (ranks * slope)
    latency = max(0.0, (t_small - slope * small) / steps)
    return round(latency, 12), round(bandwidth, 6)


def _worker(out: str, nbytes: int) -> None:
    import torch

    import gradsync
    from gradsync.collectives import Communicator, Op

    info = gradsync.init(timeout=300)
    torch.set_num_threads(1)
    comm = Communicator()
    sizes = (max(4, nbytes // SMALL_FRACTION // 4 * 4), nbytes // 4 * 4)  # whole float32 elements
    times: dict[int, list[float]] = {size: [] for size in sizes}
    for _ in range(REPEATS + 1):  # the first round warms the connections up and is dropped
        for size in sizes:
            comm.barrier(Op.LINK_PROBE)
            times[size].append(comm.timed_all_reduce(Op.LINK_PROBE, torch.zeros(size // 4)))
    if info.rank == 0:
        Path(out).write_text(json.dumps({size: statistics.median(t[1:]) for size, t in times.items()}))
    gradsync.shutdown()


if __name__ == "__main__":
    _worker(sys.argv[1], int(sys.argv[2]))
