"""Whether the job's store answers: the rendezvous endpoint (a TCP connect, or a bind where this node serves it),
or each member of an etcd cluster (``--store etcd://``, through the job's own etcd client)."""

from __future__ import annotations

import socket
import time

from gradsync.doctor.job import Job
from gradsync.doctor.network import interfaces, resolve
from gradsync.doctor.result import Result
from gradsync.errors import ConfigError
from gradsync.runtime import etcd_access, store_server
from gradsync.runtime.endpoints import join, split
from gradsync.runtime.etcd_access import EtcdAccess
from gradsync.runtime.run_flags import RDZV_PORT
from gradsync.store.etcd_client import EtcdClient, EtcdUnavailable
from gradsync.store.etcd_refusal import EtcdRefused
from gradsync.store.etcd_store import parse_endpoints

CONNECT_S = 2.0  # one TCP connect or one etcd request


def check_rendezvous(job: Job) -> Result:
    """The TCP store the job's nodes meet at: free to serve where this node serves it, answering where another
    node does."""
    name = "rendezvous store"
    if job.store:
        return Result(name, "skip", "the job's store is the etcd cluster (--store): see 'etcd store'")
    if job.endpoint is None:
        return Result(name, "ok", "one node: this node's launcher serves the store on a free port")
    try:
        host, port = split(job.endpoint, job.endpoint, RDZV_PORT)
    except ConfigError as exc:
        return Result(name, "fail", exc.message, "give HOST:PORT, e.g. --rdzv-endpoint node0:29400")
    addresses = resolve(host)
    if not addresses:
        why = "does not resolve" if addresses == [] else "took over 2 s to look up"
        return Result(name, "fail", f"{host} {why}", "give the serving host's address, or a name every node resolves")
    served = store_server.served_here(host, job.local_addr, job.elastic, job.max_nodes)
    if served or set(addresses) <= _local_addresses():
        return _free_to_serve(host, port, job.max_nodes)
    return _answers(host, port)


def _local_addresses() -> set[str]:
    return {a for i in interfaces() for a in i.addresses}


def _free_to_serve(host: str, port: int, nodes: int) -> Result:
    """This node serves the store: it must be able to listen on its address and port, as gradsync run checks
    before it starts (gradsync/runtime/store_server.py)."""
    name, where = "rendezvous store", join(host, port)
    if port == 0:
        return Result(name, "ok", f"this node serves the store at {host} on a free port")
    try:
        address = store_server.listen_address(host, nodes)
        store_server.listening_socket(address, port).close()
    except ConfigError as exc:
        return Result(
            name,
            "fail",
            f"this node serves the store at {where}, and {exc.message}",
            "another job may be using it: pick a free port with --master-port or --rdzv-endpoint HOST:PORT",
        )
    listens = "every interface" if address == store_server.EVERY_INTERFACE else f"{address} only"
    return Result(name, "ok", f"this node serves the store at {where} (the port is free), listening on {listens}")


def _answers(host: str, port: int) -> Result:
    """Another node serves the store: it should accept a TCP connection (nothing is sent)."""
    name = "rendezvous store"
    began = time.monotonic()
    try:
        with socket.create_connection((host, port), timeout=CONNECT_S):
            pass
    except ConnectionRefusedError:
        return Result(
            name,
            "warn",
            f"{host}:{port} refused the connection: nothing serves the store there yet",
            f"start the job on {host} first (its launcher serves the store), or check the port",
        )
    except OSError as exc:  # a timeout, or no route
        why = f"no answer within {CONNECT_S:g}s" if isinstance(exc, TimeoutError) else exc.strerror or str(exc)
        return Result(
            name, "warn", f"{host}:{port}: {why}", f"check that {host} is up and that no firewall drops port {port}"
        )
    return Result(name, "ok", f"{host}:{port} answers ({(time.monotonic() - began) * 1e3:.0f} ms to connect)")


def check_etcd(job: Job) -> Result:
    """Each etcd member's status, through the job's own client (its TLS settings and user); the job needs a
    majority with a leader."""
    name = "etcd store"
    if job.store is None:
        return Result(name, "skip", "no --store: the rendezvous host's launcher serves the job's store")
    try:
        endpoints, _ = parse_endpoints(job.store)
    except ConfigError as exc:
        return Result(name, "fail", exc.message, "give the members as etcd://HOST:PORT,HOST:PORT,...")
    try:
        access = etcd_access.from_flags(job.store, job.store_conf)
    except ConfigError as exc:
        return Result(name, "fail", exc.message, "fix --rdzv-conf as said: gradsync run refuses it too")
    result = _members(job, endpoints, access)
    exposed = etcd_access.exposed(access)
    if exposed and result.status == "ok":
        return Result(name, "warn", f"{result.detail}; {' '.join(exposed)}", "chmod 600 each file named")
    return result


def _members(job: Job, endpoints: list[str], access: EtcdAccess) -> Result:
    """Each member's answer to the job's own client, judged: all serve, a majority, or too few."""
    name = "etcd store"
    prefix = f"gradsync/{job.job_name}/" if job.job_name != "none" else None
    answers = {endpoint: _member_status(endpoint, access, prefix) for endpoint in endpoints}
    refused = [what for endpoint, (_, what) in answers.items() if what.startswith("refused this client")]
    if refused:
        return Result(name, "fail", "; ".join(refused), "fix what it names; the job's clients would be refused too")
    detail = "; ".join(f"{endpoint}: {what}" for endpoint, (_, what) in answers.items())
    serving = sum(healthy for healthy, _ in answers.values())
    if serving == len(endpoints):
        return Result(name, "ok", detail)
    fix = "start the members that do not answer, or check the addresses (etcdctl endpoint health on the hosts)"
    if serving > len(endpoints) // 2:
        return Result(name, "warn", f"{detail} (a majority serves: the job can run)", fix)
    return Result(name, "fail", f"{detail} (no majority serves: the job cannot coordinate)", fix)


def _member_status(endpoint: str, access: EtcdAccess, prefix: str | None) -> tuple[bool, str]:
    """(whether the member serves with a leader, what it said): one request, tried once."""
    client = EtcdClient([endpoint], request_s=CONNECT_S, unavailable_s=0.0, access=access, prefix=prefix)
    try:
        status = client.call("/v3/maintenance/status", {})
    except EtcdRefused as exc:
        return False, f"refused this client: {exc}"
    except EtcdUnavailable as exc:
        return False, "refused the connection" if exc.all_refused else f"no answer within {CONNECT_S:g}s, or an error"
    version = status.get("version", "?")
    if str(status.get("leader", "0")) == "0":
        return False, f"etcd {version}, without a leader (no quorum)"
    return True, f"etcd {version}, leader {status['leader']}"
