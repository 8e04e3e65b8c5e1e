"""A TCPStore server that listens on the job's address only, not on every interface of the host.

torch's TCPStore server binds every interface whatever host name it is given: the name is the client's, and the
server's options carry only a port (``TCPStoreOptions`` in torch/include/torch/csrc/distributed/c10d/TCPStore.hpp;
``Socket::listen(std::uint16_t port, ...)`` in socket.h; libuv's server, the default, binds ``::`` or ``0.0.0.0``).
Its one way to listen elsewhere is ``master_listen_fd``: the server takes over a socket already bound (libuv's
``uv_tcp_open`` on it, then ``uv_listen``). So a store is served here on a socket bound to the address the job was
given, and handed over by its descriptor.

Which address: an IP address is itself; ``0.0.0.0`` or ``::`` is every interface (asked for); a name is its first
address here, IPv4 first. A name that resolves to loopback here while the job spans several nodes (Debian maps the
host name to 127.0.1.1) listens on every interface, as torch's does: the other nodes know this host by that name at
another address, which only a flag (``--local-addr``, an IP address in ``--rdzv-endpoint``) can name.
"""

from __future__ import annotations

import datetime
import errno
import socket

import torch.distributed as dist

from gradsync.errors import ConfigError
from gradsync.runtime.endpoints import is_loopback, is_unspecified, join

_THIS_HOST = ("localhost", "127.0.0.1", "::1")
EVERY_INTERFACE = "::"  # IPv6 and IPv4 (dual stack), as torch's own server listens; 0.0.0.0 without IPv6


def listen_address(host: str, nodes: int) -> str:
    """The address a store served for clients of ``host`` listens on, on a job of ``nodes`` nodes at most."""
    if is_unspecified(host):
        return host
    try:
        found = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ConfigError(f"{host} does not resolve here ({exc.strerror}): give the serving node's address.") from None
    addresses = sorted(found, key=lambda a: a[0] != socket.AF_INET)  # IPv4 first, in the resolver's order
    address = str(addresses[0][4][0])
    if is_loopback(address) and not is_loopback(host) and nodes > 1:
        return EVERY_INTERFACE
    return address


def listening_socket(address: str, port: int) -> socket.socket:
    """A TCP socket bound to ``address`` and ``port`` (0: a free one), listening. A port in use or an address that
    is not this host's is refused by name."""
    if address == EVERY_INTERFACE and not socket.has_ipv6:
        address = "0.0.0.0"
    sock = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM)
    try:
        # A port a store of an ended job left in TIME_WAIT can be bound again; one in use cannot (Linux).
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if address == EVERY_INTERFACE:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind((address, port))
        sock.listen(socket.SOMAXCONN)
    except OSError as exc:
        sock.close()
        raise _bind_error(address, port, exc) from None
    return sock


def _bind_error(address: str, port: int, exc: OSError) -> ConfigError:
    where = join(address, port)
    if exc.errno == errno.EADDRNOTAVAIL:
        return ConfigError(
            f"the job's store cannot listen on {where}: {address} is not an address of this host. The node that "
            "serves it must own the endpoint's address: give one of its addresses (--rdzv-endpoint, --local-addr)."
        )
    return ConfigError(
        f"port {port} cannot be bound on {address} (the rendezvous/master port): {exc.strerror}. "
        "Another job may be using it; pick a free one with --master-port or --rdzv-endpoint HOST:PORT."
    )


def served_here(host: str, local_addr: str | None, elastic: bool, nodes: int) -> bool:
    """Whether this node serves the job's TCP store for clients of ``host``: the endpoint is this host's loopback
    (``localhost``, 127.0.0.1, ::1), every interface or this node's ``--local-addr``; with ``--elastic``, also a job
    of one node (its launcher serves the store, whatever the endpoint). Another loopback address (127.0.0.2) may be
    a node of its own: tests and labs give one to each."""
    return host in _THIS_HOST or is_unspecified(host) or host == local_addr or (elastic and nodes == 1)


def check_port(host: str, port: int, nodes: int) -> None:
    """Refuse at once, naming the port, if a store for ``host`` could not listen on ``port`` here (torch elastic
    would wait on it for minutes: another job on that port, or a leftover process). Port 0 is always free."""
    if port != 0:
        listening_socket(listen_address(host, nodes), port).close()


def serve(host: str, port: int, nodes: int, timeout: datetime.timedelta, **options) -> dist.TCPStore:
    """A TCPStore server for clients of ``host:port`` (port 0: a free one, read back from ``.port``), listening on
    :func:`listen_address` only. ``options``: TCPStore's own (``world_size``, ``wait_for_workers``, ...)."""
    address = listen_address(host, nodes)
    sock = listening_socket(address, port)
    try:
        store = dist.TCPStore(
            host if is_unspecified(address) else address,  # the server's own client: an address it listens on
            sock.getsockname()[1],
            is_master=True,
            timeout=timeout,
            master_listen_fd=sock.fileno(),
            **options,
        )
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the server owns the descriptor now, and closes it with the store
    return store
