"""A small network lab on one machine: N "hosts" as network namespaces on a bridge, each link shaped by tc.

Host i is namespace ``{prefix}-h{i}`` at 10.77.0.{i+1}/24 on interface ``eth0``; a switch namespace holds the
bridge. Every link is shaped in both directions (tbf at ``rate``, optional netem ``delay``). Everything is removed
on exit, also after a failure, and stale namespaces of the same prefix are removed first. Needs root.

What the kernel must offer (namespaces and veth pairs, tc's tbf, netem for a delay) is probed once per process by
gradsync's own probe (gradsync/doctor/kernel.py, the one ``gradsync doctor`` reports): :func:`available` says which
feature a lab with these links lacks, and :func:`lab` refuses, naming it, before it makes anything.
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator

from gradsync.doctor import kernel

SUBNET = "10.77.0"


@dataclasses.dataclass(frozen=True)
class Host:
    index: int
    namespace: str
    address: str
    interface: str = "eth0"

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.namespace, *argv]


def _sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), check=check, capture_output=True, text=True)


class LabUnavailable(RuntimeError):
    """This kernel lacks a feature the lab was asked for; the message names it (``netem``, ``tbf``, ...)."""


def needs(rate: bool = True, delay: bool = False) -> list[str]:
    """The kernel features (gradsync.doctor.kernel.FEATURES) a lab with these links uses."""
    return ["namespaces", *(["tbf"] if rate else []), *(["netem"] if delay else [])]


def available(rate: bool = True, delay: bool = False) -> str | None:
    """None if a lab can be made here with links shaped to a rate (``rate``) and delayed (``delay``), else why not,
    naming the missing feature."""
    return kernel.missing(needs(rate, delay))


def _shape(namespace: str, dev: str, rate: str | None, delay: str | None, loss: str | None = None) -> None:
    # netem at the root with tbf as its child: tbf is classless, so it cannot be the parent of netem.
    qdisc = ["ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", dev]
    parent = ["root", "handle", "1:"]
    if delay or loss:
        impairments = [*(["delay", delay] if delay else []), *(["loss", loss] if loss else [])]
        _sh(*qdisc, *parent, "netem", *impairments, "limit", "100000")
        parent = ["parent", "1:1", "handle", "10:"]
    if rate:
        # burst: a few ms of traffic at this rate, else tbf caps throughput far below `rate`.
        _sh(*qdisc, *parent, "tbf", "rate", rate, "burst", "1mbit", "latency", "100ms")


def remove(prefix: str) -> None:
    listed = _sh("ip", "netns", "list", check=False).stdout.split("\n")
    for line in listed:
        name = line.split(" ")[0]
        if name.startswith(prefix + "-"):
            _sh("ip", "netns", "del", name, check=False)


@contextlib.contextmanager
def lab(
    hosts: int = 2, rate: str | None = "1gbit", delay: str | None = None, prefix: str = "gsnet", subnet: str = SUBNET
) -> Iterator[list[Host]]:
    """Create ``hosts`` namespaces on one shaped bridge; yield them; remove everything afterwards (also when the
    process is stopped with SIGTERM, which would otherwise skip the cleanup). ``subnet``: the first three octets of
    the hosts' addresses (inside the namespaces only: no route from this host's own network reaches them).

    Raises :class:`LabUnavailable`, naming the feature, where this kernel cannot make these links (netem for a
    ``delay``, tbf for a ``rate``), before anything is made."""
    reason = available(rate=rate is not None, delay=delay is not None)
    if reason is not None:
        raise LabUnavailable(f"a lab with rate={rate!r}, delay={delay!r}: {reason}")
    remove(prefix)
    with _sigterm_exits():
        yield from _lab(hosts, rate, delay, prefix, subnet)


@contextlib.contextmanager
def lossy(host: Host, loss: str, rate: str | None) -> Iterator[None]:
    """Drop ``loss`` (netem's word: ``"5%"``) of what ``host`` sends while the block runs, its link keeping ``rate``
    (the lab's); needs netem (:func:`available` with ``delay=True`` says whether this kernel has it)."""
    root = host.command(["tc", "qdisc", "del", "dev", host.interface, "root"])
    _sh(*root)
    try:
        _shape(host.namespace, host.interface, rate, None, loss)
        yield
    finally:
        _sh(*root, check=False)
        _shape(host.namespace, host.interface, rate, None)


# A MAC address no host has: frames sent to it are flooded by the bridge and dropped by every host's interface.
NOWHERE = "02:00:00:00:de:ad"


@contextlib.contextmanager
def partition(hosts: list[Host], side: set[int]) -> Iterator[None]:
    """Split the lab in two while the block runs: the hosts whose index is in ``side`` reach each other, the others
    reach each other, and nothing crosses, as when a switch between two racks fails.

    Packets across are dropped silently, with no error to either sender (connections time out, as over a real
    partition): each host's neighbour entry for every host on the other side names an address no interface has.
    This kernel has no tc actions (``action drop``) and a blackhole route fails the sender at once, so the
    neighbour table is the tool. Healed on exit, also after a failure."""
    crossing = [(a, b) for a in hosts for b in hosts if (a.index in side) != (b.index in side)]
    try:
        for a, b in crossing:
            _sh(
                *a.command(
                    ["ip", "neigh", "replace", b.address, "lladdr", NOWHERE, "dev", a.interface, "nud", "permanent"]
                )
            )
        yield
    finally:
        for a, b in crossing:
            _sh(*a.command(["ip", "neigh", "del", b.address, "dev", a.interface]), check=False)


@contextlib.contextmanager
def _sigterm_exits() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _lab(hosts: int, rate: str | None, delay: str | None, prefix: str, subnet: str) -> Iterator[list[Host]]:
    switch = f"{prefix}-sw"
    made: list[Host] = []
    try:
        _sh("ip", "netns", "add", switch)
        _sh("ip", "-n", switch, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", switch, "link", "set", "br0", "up")
        for i in range(hosts):
            host = Host(i, f"{prefix}-h{i}", f"{subnet}.{i + 1}")
            _sh("ip", "netns", "add", host.namespace)
            _sh("ip", "link", "add", f"{prefix}{i}a", "type", "veth", "peer", "name", f"{prefix}{i}b")
            _sh("ip", "link", "set", f"{prefix}{i}a", "netns", host.namespace)
            _sh("ip", "link", "set", f"{prefix}{i}b", "netns", switch)
            _sh("ip", "-n", host.namespace, "link", "set", f"{prefix}{i}a", "name", host.interface)
            _sh("ip", "-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", host.interface)
            _sh("ip", "-n", host.namespace, "link", "set", host.interface, "up")
            _sh("ip", "-n", host.namespace, "link", "set", "lo", "up")
            _sh("ip", "-n", switch, "link", "set", f"{prefix}{i}b", "master", "br0")
            _sh("ip", "-n", switch, "link", "set", f"{prefix}{i}b", "up")
            _shape(host.namespace, host.interface, rate, delay)  # host → switch
            _shape(switch, f"{prefix}{i}b", rate, delay)  # switch → host
            made.append(host)
        yield made
    finally:
        remove(prefix)
