"""The kernel features gradsync's lab needs (lab/netlab.py: hosts as network namespaces joined by veth pairs,
links shaped by tc), probed once in a throwaway namespace that is removed again.

``namespaces``: ``ip netns add`` works (root, iproute2) and a veth pair can be made in it; ``tbf``: tc's token
bucket qdisc, which sets a link's rate; ``netem``: the qdisc that delays a link (some kernels are built without
it). Only the lab needs them: the tests and benchmarks that use it skip, naming the feature, where one is missing.
lab/netlab.py probes through :func:`missing`, so the lab and ``gradsync doctor`` never disagree.
"""

from __future__ import annotations

import functools
import os
import secrets
import shutil
import subprocess
from collections.abc import Iterable

from gradsync.doctor.result import Result

FEATURES = {
    "namespaces": "network namespaces and veth pairs (ip netns)",
    "tbf": "tc's tbf qdisc (a link's rate)",
    "netem": "tc's netem qdisc (a link's delay)",
}
COMMAND_S = 5.0  # one ip or tc command: local, no traffic; a stuck one is reported, not waited for
_FIXES = {
    "namespaces": "run as root with iproute2 installed (apt-get install iproute2)",
    "tbf": "load it: modprobe sch_tbf",
    "netem": "load it: modprobe sch_netem (some distributions ship it in a kernel-modules-extra package)",
}


def _run(*argv: str) -> str | None:
    """None if ``argv`` succeeded, else what it said."""
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=COMMAND_S)
    except subprocess.TimeoutExpired:
        return f"{argv[0]} did not finish within {COMMAND_S:g}s"
    except OSError as exc:
        return str(exc)
    return None if done.returncode == 0 else (done.stderr.strip() or f"{argv[0]} exited with {done.returncode}")


def probe() -> dict[str, str | None]:
    """Each feature of :data:`FEATURES` mapped to why it is missing here, or to None where it is present."""
    if shutil.which("ip") is None:
        return {name: f"{name}: ip (iproute2) is not installed" for name in FEATURES}
    namespace = f"gsdoctor-{os.getpid()}-{secrets.token_hex(3)}"  # unique: other runs may probe at the same time
    failed = _run("ip", "netns", "add", namespace)
    if failed:
        reason = f"namespaces: cannot create a network namespace ({failed}); the lab runs as root"
        return _without_namespaces(reason)
    try:
        return _probe_inside(namespace)
    finally:
        _run("ip", "netns", "del", namespace)  # its veth pair goes with it


def _probe_inside(namespace: str) -> dict[str, str | None]:
    failed = _run("ip", "-n", namespace, "link", "add", "gsd0", "type", "veth", "peer", "name", "gsd1")
    failed = failed or _run("ip", "-n", namespace, "link", "set", "gsd0", "up")
    if failed:
        reason = f"namespaces: cannot make a veth pair ({failed})"
        return _without_namespaces(reason)
    return {
        "namespaces": None,
        "tbf": _qdisc(namespace, "tbf", "rate", "1gbit", "burst", "1mbit", "latency", "100ms"),
        "netem": _qdisc(namespace, "netem", "delay", "1ms"),
    }


def _without_namespaces(reason: str) -> dict[str, str | None]:
    return {"namespaces": reason, "tbf": "tbf: not probed (no namespace)", "netem": "netem: not probed (no namespace)"}


def _qdisc(namespace: str, kind: str, *parameters: str) -> str | None:
    """None if ``kind`` can shape a link here (added to the veth, then removed), else why not, naming it."""
    if shutil.which("tc") is None:
        return f"{kind}: tc (iproute2) is not installed"
    failed = _run("tc", "-n", namespace, "qdisc", "add", "dev", "gsd0", "root", "handle", "1:", kind, *parameters)
    if failed:
        return f"{kind} is not in this kernel ({failed})"
    _run("tc", "-n", namespace, "qdisc", "del", "dev", "gsd0", "root")
    return None


@functools.cache
def features() -> dict[str, str | None]:
    """:func:`probe`, once per process: the lab asks before every namespace it makes."""
    return probe()


def missing(needed: Iterable[str]) -> str | None:
    """Why the first of ``needed`` (names of :data:`FEATURES`) is missing here, naming it; None if all are here."""
    found = features()
    reasons = [found[name] for name in needed if found[name] is not None]
    return reasons[0] if reasons else None


def check_lab() -> list[Result]:
    """One optional row per feature: ok, or warn with how to get it (a job never needs these)."""
    rows = []
    for name, found in features().items():
        if found is None:
            rows.append(Result(f"lab: {name}", "ok", FEATURES[name], optional=True))
        else:
            rows.append(Result(f"lab: {name}", "warn", found, _FIXES[name], optional=True))
    return rows
