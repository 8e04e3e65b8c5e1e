"""The network interface gloo will pick, and whether the other hosts of a job can reach it.

gloo binds the interface ``GLOO_SOCKET_IFNAME`` names; without it, the address this host's name resolves to, and
when that is no address of this host, the loopback address (gloo warns once). A loopback address works while every
node is on this machine and breaks a job across hosts: the others are told to connect to 127.0.0.1.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from gradsync.doctor.job import GLOO_IFNAME_VARIABLE, Job
from gradsync.doctor.result import Result
from gradsync.errors import ConfigError
from gradsync.runtime.endpoints import is_loopback, split
from gradsync.runtime.run_flags import RDZV_PORT

RESOLVE_S = 2.0  # a name lookup that takes longer is reported as unanswered (a resolver can hang for 30 s)
_SIOCGIFADDR = 0x8915  # Linux's ioctl for an interface's IPv4 address
_IFF_UP = 0x1
T = TypeVar("T")


@dataclass(frozen=True)
class Interface:
    """One network interface of this host: whether it is up, and its addresses (link-local ones left out)."""

    name: str
    up: bool
    addresses: tuple[str, ...]

    @property
    def loopback(self) -> bool:
        return bool(self.addresses) and all(ipaddress.ip_address(a).is_loopback for a in self.addresses)


def interfaces() -> list[Interface]:
    """This host's interfaces (Linux: /sys/class/net and /proc/net/if_inet6; elsewhere, names only)."""
    ipv6 = _ipv6_addresses()
    found = []
    for _, name in socket.if_nameindex():
        addresses = tuple(a for a in (_ipv4_address(name),) if a) + tuple(ipv6.get(name, ()))
        found.append(Interface(name, _is_up(name), addresses))
    return found


def _is_up(name: str) -> bool:
    try:
        return bool(int(Path(f"/sys/class/net/{name}/flags").read_text(), 16) & _IFF_UP)
    except (OSError, ValueError):
        return True  # not Linux: say nothing against it


def _ipv4_address(name: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # no traffic: an ioctl on an unbound socket
        try:
            answer = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:  # no IPv4 address (or not Linux)
            return None
    return socket.inet_ntoa(answer[20:24])


def _ipv6_addresses() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    try:
        lines = Path("/proc/net/if_inet6").read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        fields = line.split()
        if len(fields) == 6 and fields[3] != "20":  # scope 0x20: link-local, which gloo cannot use across hosts
            found.setdefault(fields[5], []).append(str(ipaddress.IPv6Address(bytes.fromhex(fields[0]))))
    return found


def bounded(lookup: Callable[[], T], timeout: float) -> list[T]:
    """``[lookup()]``, or ``[]`` if it took over ``timeout``: a resolver can hang for 30 s. It runs on a daemon
    thread, so that a hung lookup does not hold the exit."""
    answer: list[T] = []
    worker = threading.Thread(target=lambda: answer.append(lookup()), daemon=True)
    worker.start()
    worker.join(timeout)
    return answer


def resolve(host: str, timeout: float = RESOLVE_S) -> list[str] | None:
    """The addresses ``host`` resolves to; [] if it does not resolve, None if the lookup took over ``timeout``."""

    def lookup() -> list[str]:
        try:
            return sorted({str(info[4][0]) for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)})
        except (OSError, UnicodeError):
            return []

    answer = bounded(lookup, timeout)
    return answer[0] if answer else None


def _on_loopback(endpoint: str) -> bool:
    try:
        return is_loopback(split(endpoint, endpoint, RDZV_PORT)[0])
    except ConfigError:
        return False


def check_interface(job: Job) -> Result:
    """The interface gloo will bind for this job, and whether the job's other hosts could reach it."""
    found = interfaces()
    if job.gloo_ifname:
        return _named_interfaces(job, found)
    return _hostname_address(job, found)


def _named_interfaces(job: Job, found: list[Interface]) -> Result:
    by_name = {i.name: i for i in found}
    chosen = []
    for name in (n.strip() for n in (job.gloo_ifname or "").split(",")):
        interface = by_name.get(name)
        problem = _interface_problem(name, interface)
        if problem or interface is None:
            names = ", ".join(i.name for i in found)
            return Result("network", "fail", problem or name, f"set {GLOO_IFNAME_VARIABLE} to one of: {names}")
        chosen.append(interface)
    where = ", ".join(f"{i.name} ({', '.join(i.addresses)})" for i in chosen)
    detail = f"{GLOO_IFNAME_VARIABLE}={job.gloo_ifname}: gloo binds {where}"
    return _judge_reach(job, found, detail, all(i.loopback for i in chosen))


def _interface_problem(name: str, interface: Interface | None) -> str | None:
    if interface is None:
        return f"{GLOO_IFNAME_VARIABLE}={name}: this host has no interface {name}"
    if not interface.up:
        return f"{GLOO_IFNAME_VARIABLE}={name}: {name} is down"
    if not interface.addresses:
        return f"{GLOO_IFNAME_VARIABLE}={name}: {name} has no address (gloo: 'Unable to find address')"
    return None


def _hostname_address(job: Job, found: list[Interface]) -> Result:
    name = socket.gethostname()
    addresses = resolve(name)
    mine = {a for i in found for a in i.addresses}
    usable = [a for a in addresses or [] if a in mine and not ipaddress.ip_address(a).is_loopback]
    if usable:
        return _judge_reach(job, found, f"the host name {name} resolves to {usable[0]}: gloo binds it", False)
    if addresses is None:
        why = f"looking up the host name {name} took over {RESOLVE_S:g}s"
    elif not addresses:
        why = f"the host name {name} does not resolve"
    else:
        why = f"the host name {name} resolves to {', '.join(addresses)}"
    return _judge_reach(job, found, f"{why}: gloo binds the loopback address", True)


def _judge_reach(job: Job, found: list[Interface], detail: str, loopback: bool) -> Result:
    """ok, unless gloo's address is loopback and the job may span hosts that are not all this machine."""
    if not loopback:
        return Result("network", "ok", detail)
    if job.max_nodes <= 1 or (job.endpoint is not None and _on_loopback(job.endpoint)):
        return Result("network", "ok", detail + " (fine: every node of this job is on this machine)")
    others = [i for i in found if i.up and i.addresses and not i.loopback]
    hint = f" (here: {', '.join(f'{i.name} {i.addresses[0]}' for i in others)})" if others else ""
    return Result(
        "network",
        "warn",
        f"{detail}; with --nnodes {job.nnodes}, the other hosts cannot reach this one there",
        f"export {GLOO_IFNAME_VARIABLE}=<the interface that reaches the other hosts>{hint}",
    )
