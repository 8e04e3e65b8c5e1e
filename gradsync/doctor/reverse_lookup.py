"""Whether this node's addresses, and the store's, can be looked up by address quickly (reverse DNS, a PTR query).

torch's c10d sockets name each peer for their messages with ``getnameinfo`` without ``NI_NUMERICHOST``
(``c10d::detail::formatSockAddr``): a TCPStore client as it connects, and the TCPStore server (libuv) for every
client it accepts, on its one thread. Where the resolver does not answer PTR queries, each lookup waits for its
timeout (5 s, twice, with glibc's defaults), and while the server waits no rank's request is served
(docs/scaling.md, "A torch trap this found"). A lookup that fails at once is fine (torch then prints the address);
only a slow one hurts.
"""

from __future__ import annotations

import ipaddress
import socket
import time

from gradsync.doctor.job import Job
from gradsync.doctor.network import bounded, interfaces, resolve
from gradsync.doctor.result import Result
from gradsync.errors import ConfigError
from gradsync.runtime.endpoints import split
from gradsync.runtime.run_flags import RDZV_PORT

LOOKUP_S = 2.0  # a reverse lookup still unanswered after this is reported (the resolver's own wait is 5 s or more)
SLOW_S = 0.5  # one that takes longer stalls the store for that long at each connection


def lookup_seconds(address: str, timeout: float | None = None) -> float | None:
    """How long a reverse lookup of ``address`` took (answered or refused); None if still unanswered at
    ``timeout`` (default ``LOOKUP_S``)."""

    def lookup() -> float:
        began = time.monotonic()
        try:
            socket.getnameinfo((address, 0), socket.NI_NUMERICSERV)  # as torch asks
        except (OSError, UnicodeError):
            pass  # refused: torch prints the address, at once
        return time.monotonic() - began

    took = bounded(lookup, LOOKUP_S if timeout is None else timeout)
    return took[0] if took else None


def _addresses(job: Job) -> list[str]:
    """What the job's store will look up: this node's addresses (the store's server looks up each client) and
    the store's (each client looks it up); loopback ones only where the job stays on this machine."""
    found = [a for i in interfaces() if i.up for a in i.addresses]
    if job.endpoint is not None:
        try:
            found += resolve(split(job.endpoint, job.endpoint, RDZV_PORT)[0]) or []
        except ConfigError:
            pass  # the flags' check says what is wrong with it
    many_hosts = job.max_nodes > 1
    return sorted({a for a in found if not (many_hosts and ipaddress.ip_address(a.partition("%")[0]).is_loopback)})


def check_reverse_lookup(job: Job) -> Result:
    """A warning, naming each address, where a reverse lookup is slow enough to stall the job's store."""
    name = "reverse lookup"
    if job.store:
        return Result(name, "skip", "the job's store is the etcd cluster (--store): no TCPStore connects")
    timed = {address: lookup_seconds(address) for address in _addresses(job)}
    slow = {a: s for a, s in timed.items() if s is None or s > SLOW_S}
    if not slow:
        return Result(name, "ok", f"each of {len(timed)} addresses looked up in under {SLOW_S:g}s")
    took = ", ".join(f"{a} ({f'over {LOOKUP_S:g}' if s is None else f'{s:.1f}'}s)" for a, s in slow.items())
    return Result(
        name,
        "warn",
        f"looking up {took} by address is slow: torch's TCPStore does it for every rank that connects, its server "
        "on its one thread, so the job's store stalls that long at each connection",
        "list every node's address in /etc/hosts on each node, or have the resolver answer (or refuse at once) "
        "reverse lookups of the nodes' addresses",
    )
