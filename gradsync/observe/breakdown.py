"""From step records to answers: where did the step's time go, how much communication hid behind backward,
and which rank arrived last at each collective (pytorch/pytorch #73600: "why is my DDP step slower?")."""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Mapping, Sequence

from gradsync.observe.arguments import require_per_rank, require_steps
from gradsync.observe.recorder import StepRecord
from gradsync.validate import require_int


@dataclasses.dataclass
class StepBreakdown:
    """Seconds per phase of one step (or medians over steps); ``overlap`` is the share of communication time
    hidden behind backward, ``exposed_comm`` the wait for communication after backward finished.

    Example::

        b = monitor.breakdown()   # this rank's median step, a StepBreakdown
        print(f"backward {b.backward * 1e3:.1f} ms, {b.exposed_comm * 1e3:.1f} ms waiting, {b.overlap:.0%} hidden")
    """

    forward: float
    backward: float
    exposed_comm: float
    optimizer: float
    total: float
    comm: float
    overlap: float
    bytes: int
    buckets: int


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def step_breakdown(step: StepRecord, next_forward_start: float | None = None) -> StepBreakdown:
    end = next_forward_start or step.optimizer_end or step.comm_end or step.forward_end
    comm_spans = _union([(b.launch, b.done) for b in step.buckets if b.launch and b.done])
    comm = sum(e - s for s, e in comm_spans)
    hidden = sum(max(0.0, min(e, step.backward_end) - s) for s, e in comm_spans) if step.backward_end else 0.0
    backward_end = step.backward_end or step.forward_end
    return StepBreakdown(
        forward=step.forward_end - step.forward_start,
        backward=max(0.0, backward_end - step.forward_end),
        exposed_comm=max(0.0, (step.comm_end or backward_end) - backward_end),
        optimizer=max(0.0, step.optimizer_end - step.optimizer_start),
        total=max(0.0, end - step.forward_start),
        comm=comm,
        overlap=hidden / comm if comm > 0 else 0.0,
        bytes=sum(b.nbytes for b in step.buckets),
        buckets=len(step.buckets),
    )


def breakdowns(steps: Sequence[StepRecord]) -> list[StepBreakdown]:
    """One breakdown per complete step; a step's total runs to the next step's forward (data loading included)."""
    out = []
    for i, step in enumerate(steps):
        if not step.comm_end:
            continue  # a step without a synced backward (evaluation, or still running)
        nxt = steps[i + 1].forward_start if i + 1 < len(steps) else None
        out.append(step_breakdown(step, nxt))
    return out


def median_breakdown(steps: Sequence[StepRecord], skip_first: int = 1) -> StepBreakdown | None:
    """Median of each phase over the steps, skipping the first (bucket rebuild, allocator warm-up).

    Example::

        per_rank = monitor.gather()              # {rank: [StepRecord, ...]}, on every rank (a collective)
        print(median_breakdown(per_rank[0]))     # rank 0's median step, its first (the rebuild's) left out
    """
    require_steps("median_breakdown", "steps", steps)
    require_int("median_breakdown", "skip_first", skip_first, minimum=0)
    items = breakdowns(steps)
    items = items[skip_first:] if len(items) > skip_first else items
    if not items:
        return None
    fields = [f.name for f in dataclasses.fields(StepBreakdown)]
    values = {f: statistics.median(getattr(b, f) for b in items) for f in fields}
    values["bytes"], values["buckets"] = int(values["bytes"]), int(values["buckets"])
    return StepBreakdown(**values)


@dataclasses.dataclass
class Arrival:
    step: int
    bucket: int
    skew: float  # seconds between the first and the last rank launching this bucket's collective
    slowest_rank: int


def arrivals(per_rank: Mapping[int, Sequence[StepRecord]]) -> list[Arrival]:
    """For each step and bucket present on every rank: how late the last rank arrived, and which rank it was.

    Example::

        for arrival in arrivals(monitor.gather())[:3]:   # who reached each bucket's all-reduce last, and how late
            print(arrival)
    """
    require_per_rank("arrivals", per_rank)
    out = []
    n_steps = min((len(s) for s in per_rank.values()), default=0)
    for i in range(n_steps):
        recs = {r: steps[i] for r, steps in per_rank.items()}
        n_buckets = min(len(s.buckets) for s in recs.values())
        for k in range(n_buckets):
            launches = {r: s.buckets[k].launch for r, s in recs.items() if s.buckets[k].launch}
            if len(launches) == len(recs):
                slowest = max(launches, key=lambda r: launches[r])
                out.append(Arrival(i, k, launches[slowest] - min(launches.values()), slowest))
    return out


def slowest_rank(per_rank: Mapping[int, Sequence[StepRecord]]) -> tuple[int, float] | None:
    """The rank that most often arrived last, and its median lateness in seconds.

    Example::

        found = slowest_rank(monitor.gather())   # None with a single rank
        if found:
            rank, late = found
            print(f"rank {rank} arrives last, {late * 1e3:.1f} ms late (median)")
    """
    found = arrivals(require_per_rank("slowest_rank", per_rank))
    if not found:
        return None
    counts: dict[int, list[float]] = {}
    for a in found:
        counts.setdefault(a.slowest_rank, []).append(a.skew)
    rank = max(counts, key=lambda r: len(counts[r]))
    return rank, statistics.median(counts[rank])
