"""What an all-reduce costs on the lab's links, as gloo runs it, so the planner is fed measured, not nominal, numbers.

Four ranks on two hosts (two per host, as every multi-host point of bench/scale/ runs them: the ring crosses the
hosts' links and keeps the local hop) time all-reduces of two bucket-like sizes (an eighth and a half of the
model's gradients), four at a time back to back as a step's buckets follow each other, and a 1-element one, several
times each (medians). The planner's ring cost, ``2 (N-1) a + 2 (N-1) / N * S / B``, is a line in ``S``: the slope
between the two sizes gives the per-hop bandwidth ``B`` (the difference also cancels the burst tbf lets through
after an idle moment), the 1-element time the per-hop latency ``a``. An earlier probe between two hosts with one
rank each read the sustained rate 7-14% low, with ±7% between runs."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import gradsync
from gradsync.collectives import Communicator, Op
from lab import netlab
from lab.ranks import wait_ranks

ROOT = Path(__file__).resolve().parents[2]
HOSTS, RANKS_PER_HOST = 2, 2
SMALL_FRACTION = 8  # the sizes: the gradients' size divided by this, and by 2 (a bucket's size, roughly)
BACK_TO_BACK = 4  # all-reduces of one size issued together
REPEATS = 7


def probe_ring(rate: str, delay: str | None, nbytes: int, timeout: float = 300) -> tuple[float, float]:
    """(per-hop latency in s, per-hop bandwidth in bytes/s) of the lab's links at ``rate``, from all-reduces of
    ``nbytes / SMALL_FRACTION`` and ``nbytes / 2`` (the model's gradients: ``nbytes``) on 4 ranks over 2 hosts."""
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
            argv = [sys.executable, "-m", "bench.scale.probe", str(out), str(nbytes)]
            procs.append(
                subprocess.Popen(host.command(["env", *[f"{k}={v}" for k, v in env.items()], *argv]), cwd=ROOT)
            )
        wait_ranks(procs, timeout, "bench.scale.probe")
    found = json.loads(out.read_text())
    out.unlink()
    return fit_ring({int(size): s for size, s in found["sizes"].items()}, ranks, found["one_element_s"])


def fit_ring(seconds: dict[int, float], ranks: int, one_element_s: float | None = None) -> tuple[float, float]:
    """Per-hop (latency, bandwidth) from the all-reduce time of two sizes on a ring of ``ranks``: the bandwidth from
    the slope, the latency from a 1-element all-reduce's time if given (the intercept of two large sizes is the
    difference of two noisy numbers), else from the intercept.

    >>> fit_ring({1000: 2 * 3 * 1e-4 + 1.5 * 1000 / 1e6, 8000: 2 * 3 * 1e-4 + 1.5 * 8000 / 1e6}, 4)
    (0.0001, 1000000.0)
    """
    (small, t_small), (large, t_large) = sorted(seconds.items())
    slope = (t_large - t_small) / (large - small)  # seconds per byte: 2 (N-1) / (N B)
    steps = 2 * (ranks - 1)
    bandwidth = steps / (ranks * slope)
    fixed = one_element_s if one_element_s is not None else t_small - slope * small
    return round(max(0.0, fixed / steps), 12), round(bandwidth, 6)


def _worker(out: str, nbytes: int) -> None:
    info = gradsync.init(timeout=300)
    torch.set_num_threads(1)
    comm = Communicator()
    sizes = (max(4, nbytes // SMALL_FRACTION // 4 * 4), nbytes // 2 // 4 * 4)  # whole float32 elements
    times: dict[int, list[float]] = {size: [] for size in sizes}
    one_element = []
    for _ in range(REPEATS + 1):  # the first round warms the connections up and is dropped
        for size in sizes:
            times[size].append(_back_to_back(comm, size) / BACK_TO_BACK)
        comm.barrier(Op.LINK_PROBE)
        one_element.append(comm.timed_all_reduce(Op.LINK_PROBE, torch.zeros(1)))
    if info.rank == 0:
        found = {"sizes": {size: statistics.median(t[1:]) for size, t in times.items()}}
        Path(out).write_text(json.dumps(found | {"one_element_s": statistics.median(one_element[1:])}))
    gradsync.shutdown()


def _back_to_back(comm: Communicator, nbytes: int) -> float:
    """Seconds for ``BACK_TO_BACK`` all-reduces of ``nbytes`` issued at once, as a step's buckets follow each other:
    the link never idles between them, so only the first gets tbf's burst."""
    tensors = [torch.zeros(nbytes // 4) for _ in range(BACK_TO_BACK)]
    comm.barrier(Op.LINK_PROBE)
    start = time.perf_counter()
    futures = [comm.all_reduce_async(Op.LINK_PROBE, t) for t in tensors]
    for future in futures:
        future.wait()
    return time.perf_counter() - start


if __name__ == "__main__":
    _worker(sys.argv[1], int(sys.argv[2]))
