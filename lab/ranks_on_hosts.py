"""Several ranks on each of several lab hosts: a benchmark's worker started WORLD = hosts x ranks_per_host times,
ranks placed host by host (rank r on host r // ranks_per_host), on loopback or in lab/netlab.py's namespaces with
the hosts' links shaped to a rate. Inside a host the ranks talk over its own address, which the kernel keeps local
(unshaped), so only traffic between hosts crosses the shaped link."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from lab import netlab
from lab.ranks import wait_ranks

ROOT = Path(__file__).resolve().parents[1]


def run_ranks(argv: list[str], hosts: int, ranks_per_host: int, link: str, port: int, timeout: float, who: str) -> None:
    """Run ``argv`` as every rank and wait for all (``link``: ``loopback``, or a tc rate such as ``1gbit``)."""
    world = hosts * ranks_per_host
    base = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "LOCAL_"))}
    base.update(WORLD_SIZE=str(world), OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), MALLOC_MMAP_THRESHOLD_="65536")
    if link == "loopback":
        envs = [
            dict(base, RANK=str(r), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
            for r in range(world)
        ]
        wait_ranks([subprocess.Popen(argv, env=e, cwd=ROOT) for e in envs], timeout, who)
        return
    reason = netlab.available()
    if reason:
        raise SystemExit(f"{who}: --link {link} needs network namespaces: {reason}")
    with netlab.lab(hosts=hosts, rate=link) as lab_hosts:
        placed = [lab_hosts[r // ranks_per_host] for r in range(world)]
        envs = [
            dict(
                base,
                RANK=str(r),
                MASTER_ADDR=lab_hosts[0].address,
                MASTER_PORT=str(port),
                GLOO_SOCKET_IFNAME=h.interface,
            )
            for r, h in enumerate(placed)
        ]
        commands = [h.command(["env", *[f"{k}={v}" for k, v in e.items()], *argv]) for h, e in zip(placed, envs)]
        wait_ranks([subprocess.Popen(c, cwd=ROOT) for c in commands], timeout, who)
