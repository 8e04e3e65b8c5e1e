"""A rank's requests reduced to what the benchmark compares and reports: the operations of one heartbeat, each key
written as a template (``beat/<me>``, ``beat/<peer>``, ``round<k>/...``), and the time between beats. The real
rank's record and each simulated rank's are reduced by this one function, so a simulation that drifted from the
code (a request more or less per beat, another interval) is caught before a figure is reported."""

from __future__ import annotations

import re
import statistics
from collections import Counter
from collections.abc import Sequence

from bench.store_load.recording import Op

HEARTBEAT_THREAD = "gradsync-heartbeat"
_MEMBER = re.compile(r"/(\d+)$")


def template(key: str, me: int) -> str:
    """``gradsync/elastic/beat/3`` -> ``beat/<me>`` (or ``beat/<peer>``), ``round7/admit_at`` -> ``round<k>/...``."""
    key = re.sub(r"round\d+", "round<k>", key.removeprefix("gradsync/elastic/"))
    return _MEMBER.sub(lambda m: "/<me>" if int(m.group(1)) == me else "/<peer>", key)


def beats(ops: Sequence[Op], me: int) -> list[tuple[float, tuple[str, ...]]]:
    """The heartbeat thread's operations, one entry per beat: (its start, its operations as ``op key``)."""
    mine = f"gradsync/elastic/beat/{me}"
    found: list[tuple[float, list[str]]] = []
    for op in ops:
        if op.thread != HEARTBEAT_THREAD:
            continue
        if op.key == mine and op.name in ("add", "set"):
            found.append((op.start, []))
        if found:
            found[-1][1].append(f"{op.name} {template(op.key, me)}")
    return [(start, tuple(names)) for start, names in found]


def steady_pattern(ops: Sequence[Op], me: int) -> tuple[tuple[str, ...], float]:
    """The most common beat (the steady state: one watched peer, no round being decided) and the median period."""
    found = beats(ops, me)
    if len(found) < 3:
        raise ValueError(f"member {me}: only {len(found)} heartbeats recorded; record for longer")
    common = Counter(names for _, names in found).most_common(1)[0][0]
    period = statistics.median(b[0] - a[0] for a, b in zip(found, found[1:]))
    return common, period


def largest_gap(ops: Sequence[Op], me: int) -> float:
    """The longest time between two of this member's beats (a watcher's timeout is judged on these)."""
    starts = [start for start, _ in beats(ops, me)]
    return max((b - a for a, b in zip(starts, starts[1:])), default=0.0)
