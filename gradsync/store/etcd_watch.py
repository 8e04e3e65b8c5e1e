"""Waiting for a key on etcd with a watch, not by polling: one request that etcd answers when the key is put.

A TCPStore's ``wait`` is answered by its server when the key is set; on etcd, polling a range would be a request
each poll for each waiting member, and while a round is decided every member waits for the leader's member list, so
etcd's load would grow with N for nothing (docs/scaling.md, "Waiting members polled"). etcd's answer is a watch:
``POST /v3/watch`` on its JSON gateway streams the key's events, one JSON object a line, from ``start_revision`` on.
The wait reads the key first (a range, which also gives the store's revision), then watches from the next revision,
so that a put between the two is not missed (etcd's own ``clientv3`` recipe).

A member that fails mid-watch costs one range on the next member (the client fails over) and a new watch there.
"""

from __future__ import annotations

import http.client
import json
import time
from typing import Any, Protocol


class Client(Protocol):
    """What a watch needs of gradsync/store/etcd_client.py's ``EtcdClient``."""

    def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """One request, failed over between the members."""

    def new_connection(self, timeout: float) -> http.client.HTTPConnection:
        """A new connection to a member, with a timeout, for the watch's stream."""

    def headers(self) -> dict[str, str]:
        """A request's headers (the etcd user's token, if any)."""


def wait_until_put(client: Client, key: str, deadline: float) -> bool:
    """Whether ``key`` (base64, as the gateway takes it) exists by ``deadline`` (monotonic). The range before each
    watch goes through ``client.call``, which fails over, and renews the token a watch may find expired."""
    while True:
        answer = client.call("/v3/kv/range", {"key": key, "keys_only": True})
        if answer.get("kvs"):
            return True
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        revision = int(answer.get("header", {}).get("revision", 0)) + 1
        try:
            if _watched_put(client.new_connection(remaining), client.headers(), key, revision):
                return True
        except (OSError, http.client.HTTPException, ValueError):  # the member failed, or the wait timed out
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))


def _watched_put(connection: http.client.HTTPConnection, headers: dict[str, str], key: str, revision: int) -> bool:
    """Watch ``key`` from ``revision`` until it is put (True) or etcd cancels the watch (False: look again; also
    where the token expired)."""
    try:
        body = {"create_request": {"key": key, "start_revision": str(revision)}}
        connection.request("POST", "/v3/watch", json.dumps(body), headers)
        response = connection.getresponse()
        if response.status != 200:
            raise http.client.HTTPException(f"HTTP {response.status} to a watch")
        while True:
            line = response.readline()
            if not line:
                return False  # the member closed the stream
            result = json.loads(line).get("result", {})
            if result.get("canceled"):  # e.g. the revision was compacted meanwhile: read the key again
                return False
            if any(event.get("type", "PUT") == "PUT" for event in result.get("events", [])):
                return True
    finally:
        connection.close()
