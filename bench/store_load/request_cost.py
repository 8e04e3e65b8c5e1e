"""What one heartbeat costs a 3-member etcd cluster, by how it is sent: the put a member's beat is now (a raft write on
every member) and the range its watcher reads, the same over TLS as an etcd user (client certificates, a token), and the
lease keep-alive a lease-based liveness would send instead (issue 41, part 5: etcd answers it on the leader, without a
raft write); and, on the secured cluster, what one token costs (etcd checks the password with bcrypt: once per process
of a job).

Clients (one ``EtcdClient`` each, as each rank has) send at a fixed total rate, the operations take turns, run after
run; it reports the members' CPU per request (summed over the three, less what they spend idle, measured just before),
p50/p99 latency and the machine's busy share. Before a figure counts it checks its mechanism: puts advanced etcd's
revision by as many puts, keep- alives advanced nothing and renewed the full TTL, and the secured cluster refused a
client without a user.

    python -m bench.store_load.request_cost --rate 1000 --seconds 10 --runs 3
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from bench.store_load.__main__ import _machine_busy
from bench.store_load.servers import Served
from gradsync.runtime.etcd_access import EtcdAccess
from gradsync.store.etcd_client import EtcdClient
from gradsync.store.etcd_refusal import EtcdRefused
from lab import certs, etcd_cluster, results

ROOT = Path(__file__).resolve().parents[2]
CLIENTS = 16
IDLE_S = 3.0
LEASE_TTL = 60


@dataclasses.dataclass
class Cluster:
    name: str
    etcd: etcd_cluster.Cluster
    access: EtcdAccess

    def clients(self) -> list[EtcdClient]:
        return [EtcdClient([m.endpoint for m in self.etcd.members], access=self.access) for _ in range(CLIENTS)]

    def cpu_seconds(self) -> float:
        """The members' CPU so far, read as the store benchmark reads its servers'."""
        return Served(self.name, [m.process.pid for m in self.etcd.members if m.process is not None]).cpu_seconds()


def _revision(client: EtcdClient) -> int:
    return int(client.call("/v3/kv/range", {"key": base64.b64encode(b"gradsync/x").decode()})["header"]["revision"])


def _paced(send: Callable[[], None], rate: float, seconds: float, latencies: list[float]) -> None:
    """``send`` at ``rate`` per second for ``seconds``, sleeping between (a slot missed is not made up)."""
    began = time.monotonic()
    slot = 0
    while (now := time.monotonic()) < began + seconds:
        wait = began + slot / rate - now
        if wait > 0:
            time.sleep(wait)
        sent = time.monotonic()
        send()
        latencies.append(time.monotonic() - sent)
        slot = max(slot + 1, int((time.monotonic() - began) * rate))


def _senders(kind: str, clients: list[EtcdClient], access: EtcdAccess) -> list[Callable[[], None]]:
    if kind == "authenticate":
        body = {"name": access.user, "password": access.password() if access.user else ""}
        return [lambda c=c: c.call("/v3/auth/authenticate", body)["token"] and None for c in clients]
    if kind == "range":  # a watcher's read of the counter it watches
        key = base64.b64encode(b"gradsync/cost/beat/0").decode()
        return [lambda c=c: c.call("/v3/kv/range", {"key": key}) and None for c in clients]
    if kind == "put":
        keys = [base64.b64encode(f"gradsync/cost/beat/{i}".encode()).decode() for i in range(len(clients))]
        return [
            lambda c=c, k=k: c.call("/v3/kv/put", {"key": k, "value": "MQ=="}) and None for c, k in zip(clients, keys)
        ]
    leases = [c.call("/v3/lease/grant", {"TTL": LEASE_TTL})["ID"] for c in clients]

    def keepalive(client: EtcdClient, lease: str) -> None:
        ttl = int(client.call("/v3/lease/keepalive", {"ID": lease})["result"]["TTL"])
        assert ttl == LEASE_TTL, f"a keep-alive renewed lease {lease} to {ttl}s, not {LEASE_TTL}s"

    return [lambda c=c, lease=lease: keepalive(c, lease) for c, lease in zip(clients, leases)]


def measure(cluster: Cluster, kind: str, rate: float, seconds: float) -> dict:
    clients = cluster.clients()
    for client in clients:  # its connection and token made, as a running job's are
        _revision(client)
    send = _senders(kind, clients, cluster.access)
    latencies: list[list[float]] = [[] for _ in clients]
    idle = cluster.cpu_seconds()
    time.sleep(IDLE_S)  # what the members spend with no request (raft's heartbeats): not a request's cost
    idle_cores = (cluster.cpu_seconds() - idle) / IDLE_S
    revision, cpu, busy = _revision(clients[0]), cluster.cpu_seconds(), _machine_busy()
    began = time.monotonic()
    threads = [
        threading.Thread(target=_paced, args=(s, rate / len(clients), seconds, lat)) for s, lat in zip(send, latencies)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    requests = sum(map(len, latencies))
    wall = time.monotonic() - began
    written = _revision(clients[0]) - revision
    expected = requests if kind == "put" else 0
    assert kind == "authenticate" or written == expected, (
        f"{kind}: etcd's revision moved {written}, not {expected}, over {requests} requests"
    )
    machine = [b - a for a, b in zip(busy, _machine_busy())]
    flat = sorted(x for lat in latencies for x in lat)
    return {
        "cluster": cluster.name,
        "request": kind,
        "rate": requests / seconds,
        "cpu_ms_per_request": (cluster.cpu_seconds() - cpu - idle_cores * wall) / requests * 1e3,
        "idle_cores": idle_cores,
        "p50_ms": flat[len(flat) // 2] * 1e3,
        "p99_ms": flat[int(len(flat) * 0.99)] * 1e3,
        "machine_busy": machine[0] / machine[1],
        "tokens_made": sum(c.tokens_made for c in clients),
    }


def _secured(work: Path) -> tuple[etcd_cluster.Security, EtcdAccess]:
    files = certs.make(work / "pki")
    security = etcd_cluster.Security(tls=files, client_cert_auth=True)
    (work / "password").write_text("bench-secret")
    access = dataclasses.replace(security.admin(), user="trainer", password_file=str(work / "password"))
    return security, access


def _refuses_without_a_user(cluster: Cluster) -> None:
    anonymous = EtcdClient([m.endpoint for m in cluster.etcd.members], access=cluster.etcd.security.admin())
    try:
        anonymous.call("/v3/kv/put", {"key": "Zm9v", "value": "MQ=="})
    except EtcdRefused:
        return
    raise AssertionError("the secured cluster served a client without a user: auth is not on")


def _summary(rows: list[dict]) -> list[dict]:
    out = []
    for key in dict.fromkeys((r["cluster"], r["request"]) for r in rows):
        runs = [r for r in rows if (r["cluster"], r["request"]) == key]
        medians = {
            f: statistics.median(r[f] for r in runs)
            for f in ("rate", "cpu_ms_per_request", "p50_ms", "p99_ms", "machine_busy")
        }
        out.append({"cluster": key[0], "request": key[1], **medians, "runs": [r["cpu_ms_per_request"] for r in runs]})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", type=float, default=1000.0, help="requests per second, all clients together")
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--out", type=Path, default=ROOT / "bench/results/store_request_cost.json")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gsrequestcost"))
    security, access = _secured(work)
    with (
        etcd_cluster.cluster(work / "plain", members=3) as plain,
        etcd_cluster.cluster(work / "secured", members=3, security=security) as secured,
    ):
        secured.enable_auth({"trainer": "bench-secret"})
        clusters = [
            Cluster("plain http", plain, EtcdAccess()),
            Cluster("TLS, client certificates, a user", secured, access),
        ]
        _refuses_without_a_user(clusters[1])
        rows = []
        for _ in range(args.runs):
            for cluster in clusters:
                kinds = [
                    ("put", args.rate),
                    ("range", args.rate),
                    ("lease keep-alive", args.rate),
                    ("authenticate", 20.0),
                ]
                for kind, rate in kinds:
                    if kind == "authenticate" and not cluster.access.user:
                        continue
                    rows.append(measure(cluster, kind, rate, args.seconds))
                    print(rows[-1], flush=True)
    summary = _summary(rows)
    for row in summary:
        print(row)
    results.write_json(args.out, {"rate": args.rate, "seconds": args.seconds, "rows": rows, "summary": summary})


if __name__ == "__main__":
    main()
