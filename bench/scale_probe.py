"""What one all-reduce costs between two lab hosts, as gloo sees it: latency and throughput from the bucket-size
tuner's own probe (gradsync.reducer.autotune.probe_link), so the planner is fed measured, not nominal, numbers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench import netlab

ROOT = Path(__file__).resolve().parents[1]
LARGE_FACTOR = 4  # the second probe's size, in multiples of the first


def probe_two_hosts(rate: str, delay: str | None, nbytes: int = 1 << 20) -> tuple[float, float]:
    """(seconds of a 1-element all-reduce, bytes/s of a large one's transfer) between two namespaces."""
    out = Path(tempfile.mkstemp(suffix=".json")[1])
    base = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "LOCAL_"))}
    base.update({"WORLD_SIZE": "2", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    with netlab.lab(hosts=2, rate=rate, delay=delay, prefix="gsprobe") as hosts:
        procs = []
        for h in hosts:
            env = dict(base, RANK=str(h.index), MASTER_ADDR=hosts[0].address, MASTER_PORT="29512")
            env["GLOO_SOCKET_IFNAME"] = h.interface
            argv = [sys.executable, "-m", "bench.scale_probe", str(out), str(nbytes)]
            procs.append(subprocess.Popen(h.command(["env", *[f"{k}={v}" for k, v in env.items()], *argv]), cwd=ROOT))
        for p in procs:
            p.wait(timeout=300)
    found = json.loads(out.read_text())
    out.unlink()
    return found["latency_s"], found["bytes_per_s"]


def _worker(out: str, nbytes: int) -> None:
    import gradsync
    from gradsync.collectives import Communicator
    from gradsync.reducer import autotune

    info = gradsync.init(timeout=300)
    comm = Communicator()
    seconds = {}
    for size in (nbytes, LARGE_FACTOR * nbytes):
        autotune.PROBE_BYTES = (size, size)
        link = autotune.probe_link(comm, info.device, size)
        seconds[size] = link.latency_s + size / link.bytes_per_s
    # The marginal rate, from the difference of two sizes: a single transfer also gets the shaper's burst (tbf lets
    # ~125 kB through at once), which made the probe read 8% above the sustained rate that a step's megabytes see.
    bytes_per_s = (LARGE_FACTOR - 1) * nbytes / (seconds[LARGE_FACTOR * nbytes] - seconds[nbytes])
    if info.rank == 0:
        Path(out).write_text(json.dumps({"latency_s": link.latency_s, "bytes_per_s": bytes_per_s}))
    gradsync.shutdown()


if __name__ == "__main__":
    _worker(sys.argv[1], int(sys.argv[2]))
