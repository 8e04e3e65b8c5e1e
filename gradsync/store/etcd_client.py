"""A client of etcd's v3 JSON gateway: one POST a request, failed over between the cluster's members, over plain
http or TLS, as an etcd user or not (gradsync/runtime/etcd_access.py says which).

It speaks HTTP/1.1 with keep-alive (etcd serves its JSON gateway on the client port), one connection per thread, and
goes on to the next member when one fails: a lost member costs a request's timeout once, not every request. A
member that refuses this client (a certificate, a password: gradsync/store/etcd_refusal.py) fails the request at
once, naming what to fix, instead of being retried as if it were down.

With a user, the client gets a token from ``/v3/auth/authenticate`` at its first request and sends it in the
``Authorization`` header (etcd's gateway reads it there). etcd expires a token (``--auth-token-ttl``, 300 s unused,
or a JWT's lifetime); the first request refused for it makes a new one, once for all the client's threads, and is
sent again.

    >>> client = EtcdClient(["127.0.0.1:2379"])  # doctest: +SKIP
    >>> client.call("/v3/maintenance/status", {})["version"]  # doctest: +SKIP
    '3.4.23'
"""

from __future__ import annotations

import http.client
import json
import threading
import time
import warnings
from collections.abc import Sequence
from typing import Any

from gradsync.errors import ConfigError, GradsyncError
from gradsync.runtime import etcd_access
from gradsync.runtime.endpoints import split
from gradsync.runtime.etcd_access import EtcdAccess
from gradsync.store import etcd_refusal
from gradsync.store.etcd_refusal import EtcdRefused

REQUEST_S = 2.0  # one request to one member; a member that does not answer within this is skipped
UNAVAILABLE_S = 10.0  # an operation that no member could serve for this long fails, naming the cluster
REFUSALS = 2  # times each member must give a refusal that one answer cannot make certain (etcd_refusal.py)


class EtcdUnavailable(GradsyncError):
    """No etcd member served a request for ``UNAVAILABLE_S``: the cluster lost its quorum, or this host its link.
    ``all_refused``: every member's host refused the connection: no member runs. (A member that answers without a
    quorum tells nothing more: it may be this host's own member, cut off with it.)"""

    def __init__(self, message: str, all_refused: bool) -> None:
        super().__init__(message)
        self.all_refused = all_refused


class _Retry(Exception):
    """etcd answered with an error another member (or a later try) may not have."""


class _TokenExpired(_Retry):
    """etcd refused the token: make a new one (and, refused again, try another member)."""


def _headers(token: str | None) -> dict[str, str]:
    return {"Content-Type": "application/json", **({"Authorization": token} if token else {})}


class _Failures:
    """One operation's failures: what each member said, which refused the connection, which refused this client."""

    def __init__(self) -> None:
        self.tries = 0
        self.said: dict[str, str] = {}
        self.refused_connection: set[str] = set()
        self.refusals: dict[str, list[EtcdRefused]] = {}

    def add(self, endpoint: str, exc: Exception) -> None:
        self.tries += 1
        self.said[endpoint] = str(exc) or type(exc).__name__
        if isinstance(exc, ConnectionRefusedError):
            self.refused_connection.add(endpoint)
        else:
            self.refused_connection.discard(endpoint)
        if isinstance(exc, EtcdRefused):
            self.refusals.setdefault(endpoint, []).append(exc)
        else:
            self.refusals.pop(endpoint, None)

    def refusal(self, endpoints: Sequence[str], times: int = REFUSALS) -> EtcdRefused | None:
        """The refusal every member gave ``times`` in a row, or None."""
        if all(len(self.refusals.get(e, ())) >= times for e in endpoints):
            return self.refusals[endpoints[0]][-1]
        return None


class EtcdClient:
    """POSTs to etcd's JSON gateway, failing over between ``endpoints`` (``host:port``), with ``access``'s TLS
    settings and user; ``prefix``: the keys it is for (a job's ``gradsync/<job>/``), named in a refusal."""

    def __init__(
        self,
        endpoints: Sequence[str],
        request_s: float = REQUEST_S,
        unavailable_s: float = UNAVAILABLE_S,
        access: EtcdAccess | None = None,
        prefix: str | None = None,
    ) -> None:
        if not endpoints:
            raise GradsyncError("an etcd store needs at least one endpoint (host:port), e.g. etcd://node0:2379")
        self.endpoints = list(endpoints)
        self.request_s = request_s
        self.unavailable_s = unavailable_s
        self.access = access or EtcdAccess()
        self.prefix = prefix  # the keys it reads and writes, for a permission refusal to name
        # Checked here too, not only by the launcher: no client sends a password over plain http unless told to.
        etcd_access.refuse_cleartext(self.access, "etcd://" + ",".join(self.endpoints))
        self._context = self.access.ssl_context()
        self._local = threading.local()  # per thread: (endpoint index, connection)
        # Since when no request was served, once one failed: the next tries each member once, not for unavailable_s.
        self._down_since: float | None = None
        self._token: str | None = None
        self._token_lock = threading.Lock()
        self.tokens_made = 0
        if not self.access.check_hostname:
            warnings.warn(
                f"etcd {','.join(self.endpoints)}: check_hostname=0, so a member's certificate need not name the "
                "host it is reached at: any certificate the CA signed passes. Reissue the members' certificates "
                "with their names (subjectAltName) and drop check_hostname=0.",
                RuntimeWarning,
                stacklevel=2,
            )

    def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """One request, answered by whichever member can; retried across members until ``unavailable_s`` (once
        the cluster was found unavailable, each member is tried once: a worker stopping says so without waiting
        ``unavailable_s`` again on each of its last operations). A refusal (``EtcdRefused``) is not retried."""
        start = time.monotonic()
        deadline = start + (0.0 if self._down_since is not None else self.unavailable_s)
        failures = _Failures()
        while True:
            endpoint = self.endpoints[self._index()]
            try:
                answer = self._authorized(endpoint, path, body)
                self._down_since = None
                return answer
            except (EtcdRefused, OSError, http.client.HTTPException, _Retry) as exc:
                if isinstance(exc, EtcdRefused) and exc.certain:
                    raise
                failures.add(endpoint, exc)
                self._next_member()
            if (refusal := failures.refusal(self.endpoints)) is not None:
                raise refusal
            if time.monotonic() >= deadline and failures.tries >= len(self.endpoints):
                raise failures.refusal(self.endpoints, times=1) or self._unavailable(path, failures, start)
            time.sleep(0.05)

    def _unavailable(self, path: str, failures: _Failures, start: float) -> EtcdUnavailable:
        self._down_since = self._down_since or start
        tried = "; ".join(f"{e}: {why}" for e, why in failures.said.items())
        return EtcdUnavailable(
            f"the etcd cluster {','.join(self.endpoints)} has served no request for "
            f"{time.monotonic() - self._down_since:.0f}s (this {path}: {tried}). It has lost its quorum (most of its "
            "members are down) or this host cannot reach it; check `etcdctl endpoint health` on the hosts.",
            all_refused=failures.refused_connection == set(self.endpoints),
        )

    def _index(self) -> int:
        return getattr(self._local, "index", 0)

    def _next_member(self) -> None:
        self._drop_connection()
        self._local.index = (self._index() + 1) % len(self.endpoints)

    def new_connection(self, timeout: float) -> http.client.HTTPConnection:
        """A connection of its own to the member this thread uses now: for one request's, or a watch's stream."""
        endpoint = self.endpoints[self._index()]
        host, port = split(endpoint, endpoint)
        if self._context is not None:
            return http.client.HTTPSConnection(host, port, timeout=timeout, context=self._context)
        return http.client.HTTPConnection(host, port, timeout=timeout)

    def headers(self) -> dict[str, str]:
        """A watch's headers: the client's token, once it has one."""
        return _headers(self._token)

    # ------------------------------------------------------------------------------ the token
    def _authorized(self, endpoint: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
        token = self._token_for(endpoint)
        try:
            return self._post(endpoint, path, body, token)
        except _TokenExpired:
            return self._post(endpoint, path, body, self._renew(endpoint, stale=token))

    def _token_for(self, endpoint: str) -> str | None:
        if self.access.user is None:
            return None
        with self._token_lock:  # one token for every thread of the client
            if self._token is None:
                self._token = self._authenticate(endpoint)
            return self._token

    def _renew(self, endpoint: str, stale: str | None) -> str | None:
        with self._token_lock:
            if self._token == stale:  # else another thread made a new one meanwhile
                try:
                    self._token = self._authenticate(endpoint)
                except EtcdRefused as exc:
                    said = f"etcd user {self.access.user}'s token expired, and making a new one failed: {exc.message}"
                    raise EtcdRefused(said) from exc
            return self._token

    def _authenticate(self, endpoint: str) -> str:
        try:
            body = {"name": self.access.user, "password": self.access.password()}
        except ConfigError as exc:  # the password file is gone, say: a refusal, not a member down
            raise EtcdRefused(exc.message) from None
        token = str(self._post(endpoint, "/v3/auth/authenticate", body, None)["token"])
        self.tokens_made += 1
        return token

    # ------------------------------------------------------------------------------ one request
    def _post(self, endpoint: str, path: str, body: dict[str, Any], token: str | None) -> dict[str, Any]:
        connection = getattr(self._local, "connection", None)
        fresh = connection is None
        if connection is None:
            connection = self._local.connection = self.new_connection(self.request_s)
        handshaken = False
        try:
            if fresh:
                connection.connect()  # the TLS handshake, where a member refuses this client's certificate
            handshaken = True
            connection.request("POST", path, json.dumps(body), _headers(token))
            response = connection.getresponse()
            raw = response.read()
        except (OSError, http.client.HTTPException) as exc:
            refusal = etcd_refusal.of_connection(endpoint, exc, self.access, fresh, handshaken, self.request_s)
            if refusal is not None:
                raise refusal from exc
            raise
        return self._answer(endpoint, path, response.status, raw)

    def _answer(self, endpoint: str, path: str, status: int, raw: bytes) -> dict[str, Any]:
        try:
            payload = json.loads(raw or b"{}")
        except ValueError:
            payload = {"error": raw.decode(errors="replace").strip()}
        if status == 200:
            return payload
        message = str(payload.get("error") or payload.get("message") or payload)
        if status == 401 and "invalid auth token" in message:
            raise _TokenExpired
        refusal = etcd_refusal.of_answer(endpoint, path, status, message, self.access, self.prefix)
        if refusal is not None:
            raise refusal
        # etcd answers 503-like errors while it elects a leader or has none: another member may serve it.
        raise _Retry(f"HTTP {status}: {message}")

    def _drop_connection(self) -> None:
        connection = getattr(self._local, "connection", None)
        if connection is not None:
            connection.close()
        self._local.connection = None
