"""``HOST:PORT`` as the job's flags write it, IPv6 included: ``[::1]:29400``, ``[fe80::1%eth0]:2379`` (brackets, as
in URLs), and the members of ``--store etcd://...``. One parser for the launchers, the workers and ``gradsync
doctor``, so that an address one of them takes the others take too.

A bare IPv6 address is refused rather than guessed at: in ``fe80::1:2379`` no rule can tell the port from the last
group of the address.

    >>> split("[::1]:29400", "--rdzv-endpoint")
    ('::1', 29400)
    >>> join("::1", 29400)
    '[::1]:29400'
"""

from __future__ import annotations

import ipaddress
import re

from gradsync.errors import ConfigError

ETCD_SCHEME = "etcd://"
ETCD_SCHEMES = (ETCD_SCHEME, "etcd+http://", "etcd+https://")  # the last: TLS (gradsync/runtime/etcd_access.py)
ETCD_PORT = 2379  # etcd's client port
_NAME = re.compile(r"^[\w.-]+$")  # a host name or an IPv4 address


def split(text: str, what: str, default_port: int | None = None) -> tuple[str, int]:
    """``HOST:PORT`` -> (host, port), the host without brackets. ``what`` names the flag in the error, e.g.
    ``"--rdzv-endpoint [::1]:29400"``; ``default_port``: the port when ``text`` gives none (else one is required)."""
    text = text.strip()
    if text.startswith("["):
        host, close, rest = text[1:].partition("]")
        if not close or (rest and not rest.startswith(":")):
            raise ConfigError(f"{what}: write an IPv6 address in brackets, then the port: [ADDRESS]:PORT.")
        _check_ipv6(host, what)
        port_text = rest[1:] if rest else None
    elif text.count(":") > 1:
        raise ConfigError(
            f"{what}: an IPv6 address without brackets, whose port cannot be told from the address: write it as "
            "[ADDRESS]:PORT, e.g. [fe80::1%eth0]:2379 or [::1]:29400."
        )
    else:
        host, colon, port_text_found = text.partition(":")
        port_text = port_text_found if colon else None
        if not _NAME.match(host):
            raise ConfigError(f"{what}: {host!r} is not a host name or an IP address; give HOST:PORT (node0:29400).")
    return host, _port(port_text, what, default_port)


def _check_ipv6(host: str, what: str) -> None:
    try:
        ipaddress.IPv6Address(host)  # a zone (%eth0) included, as a link-local address needs
    except ValueError:
        raise ConfigError(f"{what}: [{host}] is not an IPv6 address (brackets hold one, e.g. [::1]:29400).") from None


def _port(text: str | None, what: str, default: int | None) -> int:
    if text is None or text == "":
        if default is None:
            raise ConfigError(f"{what} is not HOST:PORT (it gives no port).")
        return default
    if not text.isdigit() or int(text) > 65535:
        raise ConfigError(f"{what} is not HOST:PORT (the port {text!r} is not a number from 0 to 65535).")
    return int(text)


def join(host: str, port: int) -> str:
    """The inverse of :func:`split`: an IPv6 host goes in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def etcd_scheme(url: str) -> str | None:
    """The etcd scheme ``url`` starts with (``etcd://``, ``etcd+http://``, ``etcd+https://``), or None."""
    return next((s for s in ETCD_SCHEMES if url.startswith(s)), None)


def etcd_members(url: str) -> tuple[list[str], str]:
    """``etcd://host1:2379,[::1]:2379[/job][?query]`` -> (["host1:2379", "[::1]:2379"], "job"): each member checked
    as HOST:PORT (the port defaults to etcd's 2379), nothing resolved."""
    members, _, job = url.removeprefix(etcd_scheme(url) or "").partition("?")[0].partition("/")
    endpoints = []
    for member in (m for m in members.split(",") if m):
        host, port = split(member, f"--store {url}: {member!r}", ETCD_PORT)
        if port == 0:
            raise ConfigError(f"--store {url}: {member!r} has port 0; give the member's client port (etcd's is 2379).")
        endpoints.append(join(host, port))
    if not endpoints:
        raise ConfigError(f"--store {url}: name the etcd members, e.g. etcd://node0:2379,node1:2379,node2:2379")
    return endpoints, job


def is_loopback(host: str) -> bool:
    """``localhost`` or a loopback address (127.0.0.0/8, ::1): reachable from this host only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.partition("%")[0]).is_loopback
    except ValueError:
        return False


def is_unspecified(host: str) -> bool:
    """``0.0.0.0`` or ``::``: every interface (what a user writes to ask for it)."""
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False
