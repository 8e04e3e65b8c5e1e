"""The stores under test, each in processes of its own whose CPU is read from /proc: torch's TCPStore (libuv, as
``gradsync run --elastic`` serves it, in a process standing in for the launcher) and a 3-member etcd cluster on
loopback (lab/etcd_cluster.py, the tests' and the labs' cluster)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from gradsync.testing import free_port
from lab import etcd_cluster

# gradsync run --elastic's own server (gradsync/runtime/store_server.py: listening on the endpoint's address only).
_SERVE = """
import datetime, sys, time
from gradsync.runtime import store_server
store = store_server.serve("127.0.0.1", int(sys.argv[1]), 64, datetime.timedelta(seconds=600), wait_for_workers=False)
print("ready", flush=True)
time.sleep(1e9)
"""


@dataclass
class Served:
    where: str  # what the simulated ranks are given, as gradsync run --elastic gives its workers
    pids: list[int]

    def cpu_seconds(self) -> float:
        """The servers' CPU so far (user + system)."""
        total = 0
        for pid in self.pids:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        return total / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def tcp_store() -> Iterator[Served]:
    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", _SERVE, str(port)], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        yield Served(f"127.0.0.1:{port}", [server.pid])
    finally:
        server.kill()
        server.wait()


@contextlib.contextmanager
def etcd(work: Path) -> Iterator[Served]:
    with etcd_cluster.cluster(work, members=3) as cluster:
        pids = [m.process.pid for m in cluster.members if m.process is not None]
        yield Served(cluster.url + "/load", pids)
