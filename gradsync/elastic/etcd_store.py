"""The job's store on an etcd cluster: torch's ``Store`` interface over etcd's v3 JSON gateway, so that no gradsync
process is the only holder of any state the job needs (issue 29).

Every operation the elastic protocol and torch's process groups use maps onto one etcd request, or a short
compare-and-swap loop: ``set`` is a put, ``check`` and ``get`` are (linearizable) ranges (a ``check`` of several
keys one read-only transaction), ``compare_set`` is a transaction, ``add`` a transaction on the key's revision,
retried when another client got in first. A ``get`` of a key not yet set waits for it, as a TCPStore's does (torch's
gloo rendezvous relies on that), and so does ``wait``: with a watch, not a poll (gradsync/elastic/etcd_watch.py).

The client speaks plain HTTP/1.1 with keep-alive (etcd serves its JSON gateway on the client port), one connection
per thread, and goes on to the next endpoint when one fails: a lost etcd member costs a request's timeout once, not
every request. The one dependency this needs is etcd itself (Debian's etcd-server 3.4; the gateway is at ``/v3/``
since 3.4). torch's own EtcdStore (torch/distributed/elastic/rendezvous/etcd_store.py) speaks etcd's v2 API through
python-etcd, which is unmaintained and which etcd 3.4 no longer serves by default.

    >>> store = EtcdStore(["127.0.0.1:2379"], prefix="gradsync/job-1/")  # doctest: +SKIP
    >>> store.set("a", "1"); store.add("n", 2); store.get("a")  # doctest: +SKIP
    b'1'
"""

from __future__ import annotations

import base64
import datetime
import http.client
import json
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from gradsync.elastic.etcd_watch import wait_until_put
from gradsync.errors import ConfigError, GradsyncError
from gradsync.runtime.endpoints import etcd_members, split

REQUEST_S = 2.0  # one request to one member; a member that does not answer within this is skipped
TXN_OPS = 128  # etcd's --max-txn-ops default: the most comparisons one transaction may hold
UNAVAILABLE_S = 10.0  # an operation that no member could serve for this long fails, naming the cluster


class EtcdUnavailable(GradsyncError):
    """No etcd member served a request for ``UNAVAILABLE_S``: the cluster lost its quorum, or this host its link.
    ``all_refused``: every member's host refused the connection: no member runs. (A member that answers without a
    quorum tells nothing more: it may be this host's own member, cut off with it.)"""

    def __init__(self, message: str, all_refused: bool) -> None:
        super().__init__(message)
        self.all_refused = all_refused


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


class EtcdClient:
    """POSTs to etcd's JSON gateway, failing over between ``endpoints`` (``host:port``)."""

    def __init__(self, endpoints: Sequence[str], request_s: float = REQUEST_S, unavailable_s: float = UNAVAILABLE_S):
        if not endpoints:
            raise GradsyncError("an etcd store needs at least one endpoint (host:port), e.g. etcd://node0:2379")
        self.endpoints = list(endpoints)
        self.request_s = request_s
        self.unavailable_s = unavailable_s
        self._local = threading.local()  # per thread: (endpoint index, connection)
        # Since when no request was served, once one failed: the next tries each member once, not for unavailable_s.
        self._down_since: float | None = None

    def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """One request, answered by whichever member can; retried across members until ``unavailable_s`` (once
        the cluster was found unavailable, each member is tried once: a worker stopping says so without waiting
        ``unavailable_s`` again on each of its last operations)."""
        start = time.monotonic()
        deadline = start + (0.0 if self._down_since is not None else self.unavailable_s)
        tries = 0
        errors: dict[str, str] = {}
        refused: set[str] = set()
        while True:
            endpoint = self.endpoints[self._index()]
            tries += 1
            try:
                answer = self._post(endpoint, path, body)
                self._down_since = None
                return answer
            except (OSError, http.client.HTTPException, _Retry) as exc:
                errors[endpoint] = str(exc) or type(exc).__name__
                if isinstance(exc, ConnectionRefusedError):
                    refused.add(endpoint)
                else:
                    refused.discard(endpoint)
                self._drop_connection()
                self._local.index = (self._index() + 1) % len(self.endpoints)
            if time.monotonic() >= deadline and tries >= len(self.endpoints):
                self._down_since = self._down_since or start
                tried = "; ".join(f"{e}: {why}" for e, why in errors.items())
                raise EtcdUnavailable(
                    f"the etcd cluster {','.join(self.endpoints)} has served no request for "
                    f"{time.monotonic() - self._down_since:.0f}s (this {path}: {tried}). It has lost its quorum (most "
                    "of its members are down) or this host cannot reach it; check `etcdctl endpoint health` on the "
                    "hosts.",
                    all_refused=refused == set(self.endpoints),
                )
            time.sleep(0.05)

    def _index(self) -> int:
        return getattr(self._local, "index", 0)

    def new_connection(self, timeout: float) -> http.client.HTTPConnection:
        """A connection of its own to the member this thread uses now: for one request's, or a watch's stream."""
        endpoint = self.endpoints[self._index()]
        host, port = split(endpoint, endpoint)
        return http.client.HTTPConnection(host, port, timeout=timeout)

    def _post(self, endpoint: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
        connection = getattr(self._local, "connection", None)
        if connection is None:
            connection = self.new_connection(self.request_s)
            self._local.connection = connection
        connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        payload = json.loads(response.read() or b"{}")
        if response.status != 200:
            # etcd answers 503-like errors while it elects a leader or has none: another member may serve it.
            raise _Retry(f"HTTP {response.status}: {payload.get('error') or payload.get('message') or payload}")
        return payload

    def _drop_connection(self) -> None:
        connection = getattr(self._local, "connection", None)
        if connection is not None:
            connection.close()
        self._local.connection = None


class _Retry(Exception):
    """etcd answered with an error another member (or a later try) may not have."""


class EtcdStore(dist.Store):
    """torch's ``Store`` on an etcd cluster; every key lives under ``prefix`` (one job's keys never meet another's).

    ``client``: one shared with other stores of this process (its connections are per thread).

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
    ) -> None:
        super().__init__()
        self.client = client or EtcdClient(endpoints, unavailable_s=unavailable_s)
        self.prefix = prefix
        self.set_timeout(timeout)

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        """How long a ``get`` or ``wait`` waits for its keys (torch's ``Store.set_timeout``)."""
        super().set_timeout(timeout)
        self._wait = timeout

    def __repr__(self) -> str:
        return f"EtcdStore(etcd://{','.join(self.client.endpoints)}, prefix={self.prefix!r})"

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
        request if it is set, else a watch until it is (gradsync/elastic/etcd_watch.py), not a poll."""
        deadline = time.monotonic() + self._wait.total_seconds()
        while (kv := self._range(key)) is None:
            if not wait_until_put(self.client.call, self.client.new_connection, self._key(key), deadline):
                raise dist.DistStoreError(f"{self!r}: timed out after {self._wait} waiting for key {key!r}")
        return base64.b64decode(kv.get("value", ""))

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        """Until every key is set (a watch on each one missing), or ``timeout`` (the store's by default)."""
        seconds = (timeout or self._wait).total_seconds()
        deadline = time.monotonic() + seconds
        for key in keys:
            if not wait_until_put(self.client.call, self.client.new_connection, self._key(key), deadline):
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
    """``etcd://host1:2379,[::1]:2379[/job]`` -> (["host1:2379", "[::1]:2379"], "job"), each member resolved."""
    endpoints, job = etcd_members(url)
    for endpoint in endpoints:
        host, port = split(endpoint, endpoint)
        try:
            socket.getaddrinfo(host, port)
        except socket.gaierror as exc:
            raise ConfigError(f"--store {url}: cannot resolve {host!r} ({exc})") from exc
    return endpoints, job
