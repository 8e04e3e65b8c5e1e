"""The job's store, whichever kind: a TCPStore served by the rendezvous host's launcher (the default), or an etcd
cluster (``gradsync run --elastic --store etcd://...``: no single point of failure). The membership code sees only
torch's ``Store`` interface, so the protocol is the same on both, and tested once.

``StoreHealth`` is the one judgement of "the store is lost" that launchers and workers share: at once when the
store's server is known to be gone, or after ``GRADSYNC_ELASTIC_STORE_LOST_SECONDS`` of failures that may be this
host's link (which may come back).
"""

from __future__ import annotations

import datetime
import time

import torch.distributed as dist

from gradsync import settings
from gradsync.runtime import etcd_access
from gradsync.runtime.endpoints import etcd_scheme, split
from gradsync.store.etcd_client import EtcdClient, EtcdUnavailable
from gradsync.store.etcd_refusal import EtcdRefused
from gradsync.store.etcd_store import EtcdStore, parse_endpoints

# How a TCPStore client fails once the server's process is gone (the connection closed or reset). A link that is
# down fails with timeouts instead, and may come back.
_SERVER_GONE = ("connection was likely closed", "broken pipe", "connection reset", "connection refused")


def is_etcd(where: str) -> bool:
    return etcd_scheme(where) is not None


def etcd_url(endpoints: str, job: str, rdzv_conf: str = "") -> str:
    """The worker's view of ``--store etcd://...`` for the job named ``job`` (its keys under ``gradsync/<job>/``),
    with ``--rdzv-conf``'s TLS files and user in its query (no secret: gradsync/runtime/etcd_access.py)."""
    access = etcd_access.from_flags(endpoints, rdzv_conf)
    return etcd_access.with_access(f"{endpoints.rstrip('/')}/{job}", access)


def open_store(where: str, timeout: float = 60.0) -> dist.Store:
    """A client of the job's store: ``host:port`` (a TCPStore) or ``etcd://h1:2379,h2:2379/<job>[?access]``."""
    return open_stores(where, 1, timeout)[0]


def open_stores(where: str, count: int, timeout: float = 60.0) -> list[dist.Store]:
    """``count`` clients of the job's store, each with its own connection (one per thread that uses it). On etcd
    they share one client, whose connections are per thread already, so that what one thread learnt (the cluster
    is unavailable) another does not pay for again."""
    wait = datetime.timedelta(seconds=timeout)
    if is_etcd(where):
        endpoints, job = parse_endpoints(where)
        prefix = f"gradsync/{job}/"
        client = EtcdClient(endpoints, access=etcd_access.from_url(where)[1], prefix=prefix)
        return [EtcdStore(endpoints, prefix=prefix, timeout=wait, client=client) for _ in range(count)]
    host, port = split(where, where)
    return [dist.TCPStore(host, port, is_master=False, timeout=wait) for _ in range(count)]


def describe(where: str) -> str:
    if is_etcd(where):
        return f"the job's store on the etcd cluster {where.partition('?')[0]}"
    return f"the job's store at {where} (served by the launcher on the rendezvous host)"


def gone_now(exc: Exception) -> str | None:
    """Why the store is lost for good, judged from one failure, or None if it may be this host's link."""
    if isinstance(exc, EtcdRefused):
        return f"it refused this client: {exc}"
    if isinstance(exc, EtcdUnavailable):
        return "every member refused the connection (none runs)" if exc.all_refused else None
    if any(sign in str(exc).lower() for sign in _SERVER_GONE):
        return "its connection was closed (the process serving it ended)"
    return None


class StoreHealth:
    """Failures of one client's store operations, judged: ``lost`` says why the store is lost, or is None."""

    def __init__(self) -> None:
        self.lost: str | None = None
        self._failing_since: float | None = None
        self._unreachable_s = settings.read_seconds("GRADSYNC_ELASTIC_STORE_LOST_SECONDS", 60.0)

    def ok(self) -> None:
        self._failing_since = None

    def failed(self, exc: Exception, since: float | None = None) -> None:
        """An operation begun at ``since`` (monotonic; default now) failed with ``exc``."""
        now = time.monotonic()
        self._failing_since = self._failing_since or since or now
        self.lost = self.lost or gone_now(exc)
        if self.lost is None and now - self._failing_since >= self._unreachable_s:
            self.lost = f"unreachable for {self._unreachable_s:.0f}s (GRADSYNC_ELASTIC_STORE_LOST_SECONDS)"
