"""The job's store on an etcd cluster: torch's ``Store`` interface over etcd's v3 JSON gateway, so that no gradsync
process is the only holder of any state the job needs (issue 29).

Every operation the elastic protocol and torch's process groups use maps onto one etcd request, or a short
compare-and-swap loop: ``set`` is a put, ``check`` and ``get`` are (linearizable) ranges (a ``check`` of several
keys one read-only transaction), ``compare_set`` is a transaction, ``add`` a transaction on the key's revision,
retried when another client got in first. A ``get`` of a key not yet set waits for it, as a TCPStore's does (torch's
gloo rendezvous relies on that), and so does ``wait``: with a watch, not a poll (gradsync/store/etcd_watch.py).

Its client (gradsync/store/etcd_client.py) speaks HTTP/1.1, or HTTPS with a CA, a client certificate and an etcd user
where the cluster wants them, and fails over between the members. The one dependency this needs is etcd itself (Debian's
etcd-server 3.4; the gateway is at ``/v3/`` since 3.4). torch's own EtcdStore
(torch/distributed/elastic/rendezvous/etcd_store.py) speaks etcd's v2 API through python-etcd, which is unmaintained and
which etcd 3.4 no longer serves by default.

    >>> store = EtcdStore(["127.0.0.1:2379"], prefix="gradsync/job-1/")  # doctest: +SKIP
    >>> store.set("a", "1"); store.add("n", 2); store.get("a")  # doctest: +SKIP
    b'1'
"""

from __future__ import annotations

import base64
import datetime
import socket
import time
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from gradsync.errors import ConfigError
from gradsync.runtime import etcd_access
from gradsync.runtime.endpoints import etcd_members, split
from gradsync.runtime.etcd_access import EtcdAccess
from gradsync.store.etcd_client import UNAVAILABLE_S, EtcdClient
from gradsync.store.etcd_watch import wait_until_put

TXN_OPS = 128  # etcd's --max-txn-ops default: the most comparisons one transaction may hold


def _b64(data: bytes | str) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def _key_end(prefix: bytes) -> bytes:
    """The end of etcd's range of keys that start with ``prefix`` (etcd's ``clientv3.GetPrefixRangeEnd``)."""
    end = bytearray(prefix)
    for i in reversed(range(len(end))):
        if end[i] < 0xFF:
            end[i] += 1
            return bytes(end[: i + 1])
    return b"\0"


class EtcdStore(dist.Store):
    """torch's ``Store`` on an etcd cluster; every key lives under ``prefix`` (one job's keys never meet another's).

    ``client``: one shared with other stores of this process (its connections are per thread); else one made
    with ``access`` (TLS, user: gradsync/runtime/etcd_access.py).

    Usable wherever torch takes a store, ``dist.PrefixStore`` and ``init_process_group(store=...)`` included, as
    long as the Python object lives: torch keeps only the C++ half of a store written in Python, whose methods
    fail with "Not implemented" once the Python object is collected."""

    def __init__(
        self,
        endpoints: Sequence[str],
        prefix: str,
        timeout: datetime.timedelta = datetime.timedelta(seconds=60),
        unavailable_s: float = UNAVAILABLE_S,
        client: EtcdClient | None = None,
        access: EtcdAccess | None = None,
    ) -> None:
        super().__init__()
        self.client = client or EtcdClient(endpoints, unavailable_s=unavailable_s, access=access, prefix=prefix)
        self.prefix = prefix
        self.set_timeout(timeout)

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        """How long a ``get`` or ``wait`` waits for its keys (torch's ``Store.set_timeout``)."""
        super().set_timeout(timeout)
        self._wait = timeout

    def __repr__(self) -> str:
        scheme = etcd_access.TLS if self.client.access.tls else etcd_access.PLAIN
        return f"EtcdStore({scheme}{','.join(self.client.endpoints)}, prefix={self.prefix!r})"

    def _key(self, key: str) -> str:
        return _b64(self.prefix + key)

    def _range(self, key: str) -> dict[str, Any] | None:
        kvs = self.client.call("/v3/kv/range", {"key": self._key(key)}).get("kvs")
        return kvs[0] if kvs else None

    # ------------------------------------------------------------------------------ torch's Store interface
    def set(self, key: str, value: str | bytes) -> None:
        self.client.call("/v3/kv/put", {"key": self._key(key), "value": _b64(value)})

    def check(self, keys: list[str]) -> bool:
        """Whether every key is set: one request for one key, one read-only transaction (no raft write) per
        ``TXN_OPS`` keys for more, as a round's leader asks of every member at once."""
        if len(keys) == 1:
            return self._range(keys[0]) is not None
        for first in range(0, len(keys), TXN_OPS):
            exists = [
                {"key": self._key(k), "target": "CREATE", "result": "GREATER", "create_revision": "0"}
                for k in keys[first : first + TXN_OPS]
            ]
            if not self.client.call("/v3/kv/txn", {"compare": exists}).get("succeeded"):
                return False
        return True

    def get(self, key: str) -> bytes:
        """The value of ``key``, waiting for it to be set (at most the store's timeout), as a TCPStore does: one
        request if it is set, else a watch until it is (gradsync/store/etcd_watch.py), not a poll."""
        deadline = time.monotonic() + self._wait.total_seconds()
        while (kv := self._range(key)) is None:
            if not wait_until_put(self.client, self._key(key), deadline):
                raise dist.DistStoreError(f"{self!r}: timed out after {self._wait} waiting for key {key!r}")
        return base64.b64decode(kv.get("value", ""))

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        """Until every key is set (a watch on each one missing), or ``timeout`` (the store's by default)."""
        seconds = (timeout or self._wait).total_seconds()
        deadline = time.monotonic() + seconds
        for key in keys:
            if not wait_until_put(self.client, self._key(key), deadline):
                raise dist.DistStoreError(f"{self!r}: timed out after {seconds:.0f}s waiting for keys {keys}")

    def add(self, key: str, amount: int) -> int:
        """Adds ``amount`` to the counter at ``key`` (0 if unset) and returns the new value, atomically: a
        transaction on the key's revision, tried again when another client changed it first."""
        while True:
            kv = self._range(key)
            current = int(base64.b64decode(kv["value"])) if kv and kv.get("value") else 0
            if amount == 0:
                return current
            compare = {"key": self._key(key), "target": "MOD", "result": "EQUAL", "mod_revision": "0"}
            if kv is not None:
                compare["mod_revision"] = kv["mod_revision"]
            put = {"requestPut": {"key": self._key(key), "value": _b64(str(current + amount))}}
            if self.client.call("/v3/kv/txn", {"compare": [compare], "success": [put]}).get("succeeded"):
                return current + amount

    def compare_set(self, key: str, expected_value: str, desired_value: str) -> bytes:
        """TCPStore's meaning: sets ``desired_value`` if the key holds ``expected_value`` (or is unset and
        ``expected_value`` is empty) and returns it; else returns the key's value (``expected_value`` if unset)."""
        if expected_value == "":
            compare = {"key": self._key(key), "target": "VERSION", "result": "EQUAL", "version": "0"}
        else:
            compare = {"key": self._key(key), "target": "VALUE", "result": "EQUAL", "value": _b64(expected_value)}
        body = {
            "compare": [compare],
            "success": [{"requestPut": {"key": self._key(key), "value": _b64(desired_value)}}],
            "failure": [{"requestRange": {"key": self._key(key)}}],
        }
        answer = self.client.call("/v3/kv/txn", body)
        if answer.get("succeeded"):
            return desired_value.encode()
        kvs = answer["responses"][0]["response_range"].get("kvs")
        return base64.b64decode(kvs[0].get("value", "")) if kvs else expected_value.encode()

    def delete_key(self, key: str) -> bool:
        return int(self.client.call("/v3/kv/deleterange", {"key": self._key(key)}).get("deleted", 0)) > 0

    def num_keys(self) -> int:
        prefix = self.prefix.encode()
        body = {"key": _b64(prefix), "range_end": _b64(_key_end(prefix)), "count_only": True}
        return int(self.client.call("/v3/kv/range", body).get("count", 0))


def parse_endpoints(url: str) -> tuple[list[str], str]:
    """``etcd://host1:2379,[::1]:2379[/job][?query]`` -> (["host1:2379", "[::1]:2379"], "job"), each member
    resolved."""
    endpoints, job = etcd_members(url)
    for endpoint in endpoints:
        host, port = split(endpoint, endpoint)
        try:
            socket.getaddrinfo(host, port)
        except socket.gaierror as exc:
            raise ConfigError(f"--store {url}: cannot resolve {host!r} ({exc})") from exc
    return endpoints, job
