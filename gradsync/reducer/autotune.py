"""Online bucket-size tuning: choose the bucket cap from this model's backward timeline and this link's speed.

torch's DDP uses fixed caps (1 MiB first bucket, then 25 MiB). Which cap is best depends on when gradients become
ready and on what an all-reduce costs (Li et al., VLDB 2020, section 5.2 and its bucket-size figure: the best size
differs by model and by link); torch has no tuner (pytorch/pytorch#118421), Horovod and Bagua tune offline with
Bayesian optimisation. gradsync tunes once, at the bucket rebuild after iteration 1, with no extra process:

1. iteration 1 records when each gradient became ready, relative to the start of backward;
2. every rank takes part in a short probe (a 1-element and a larger all-reduce, best of three) that measures the
   link's latency and throughput;
3. rank 0 replays the backward timeline for each candidate cap: buckets launch in order once full and run one at a
   time, each costing ``latency + bytes / throughput``; the predicted end of the last all-reduce is the score;
4. a cap is proposed only if it is predicted to save at least ``MIN_GAIN`` of backward + communication time, and
   among candidates within ``TIE`` of the best the largest wins (fewer buckets, fewer launches). Rank 0's proposal
   travels in the rebuild broadcast, so every rank builds identical buckets.

The model is a hypothesis: it assumes communication overlaps backward for free, which is false where gloo's
reductions and copies compete with backward for the same cores. So a proposal is only adopted once real steps
confirm it (:mod:`gradsync.reducer.rebuild` alternates it with torch's caps and keeps the faster).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gradsync.collectives.communicator import Communicator, Op
from gradsync.reducer import buckets
from gradsync.reducer.buckets import MIB, assign_buckets

CANDIDATE_CAPS_MB = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 25.0)
# The large probe: at least 1 MiB (else its time is mostly latency and the throughput estimate is noise), at most
# 4 MiB (4 MiB / 125 MB/s: a few tens of ms at 1 Gbit/s, times PROBE_REPEATS), and no more than the gradients.
PROBE_BYTES = (1 * MIB, 4 * MIB)
PROBE_REPEATS = 3
MIN_GAIN = 0.05  # of the predicted backward + communication time under the default caps
TIE = 0.01


@dataclass(frozen=True)
class LinkCost:
    """What one all-reduce of ``n`` bytes costs on this process group: ``latency_s + n / bytes_per_s``."""

    latency_s: float
    bytes_per_s: float

    def seconds(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bytes_per_s


@dataclass(frozen=True)
class TrialResult:
    """Real synced steps (first gradient to ``.grad`` final) under the proposed caps and under torch's, alternated."""

    pairs: int
    proposed_s: float  # median step under the proposed caps
    default_s: float  # median step under torch's caps
    ratio: float  # median of the paired ratios proposed / default
    kept: bool

    def describe(self) -> str:
        verdict = "kept" if self.kept else "rejected"
        return (
            f"measured {self.ratio:.3f}x over {self.pairs} paired steps ({self.proposed_s * 1e3:.1f} vs "
            f"{self.default_s * 1e3:.1f} ms): {verdict}"
        )


@dataclass(frozen=True)
class BucketTuning:
    """The tuner's decision and its evidence (``ddp.reducer.tuning``), for logs and reports."""

    size_limits: list[int]  # the caps in force (first bucket, the others)
    default_limits: list[int]  # torch's caps
    proposed_limits: list[int]  # what the cost model proposed (torch's caps when nothing was predicted to gain)
    predicted_s: dict[float, float]  # candidate cap (MiB) -> predicted end of the last all-reduce after backward start
    default_s: float
    link: LinkCost
    trial: TrialResult | None = None  # None: nothing to check, or the check has not finished

    def describe(self) -> str:
        first, cap = (limit / MIB for limit in self.size_limits)
        text = f"bucket cap {cap:g} MiB (first {first:g} MiB)"
        best = min(self.predicted_s, key=self.predicted_s.__getitem__)
        if self.proposed_limits == self.default_limits:
            text += (
                f", torch's: no cap predicted to save {MIN_GAIN:.0%} (best {best:g} MiB: "
                f"{self.predicted_s[best] * 1e3:.1f} vs {self.default_s * 1e3:.1f} ms)"
            )
        else:
            proposed = self.proposed_limits[1] / MIB
            predicted = self.predicted_s.get(proposed, self.default_s)  # this rank's estimate for rank 0's proposal
            text += (
                f"; {proposed:g} MiB proposed, backward + all-reduce predicted {predicted * 1e3:.1f} ms vs "
                f"{self.default_s * 1e3:.1f} ms with torch's caps, "
                + (self.trial.describe() if self.trial is not None else "being measured")
            )
        link = self.link
        return text + f"; link {link.bytes_per_s / 1e6:.0f} MB/s, {link.latency_s * 1e3:.2f} ms per all-reduce"


def tune(
    comm: Communicator,
    params: Sequence[torch.Tensor],
    order: Sequence[int],
    times: tuple[Sequence[int], Sequence[float], float],
    default_limits: Sequence[int],
) -> BucketTuning:
    """Probe the link (every rank must call this) and propose caps for ``params`` bucketed in ``order``.

    ``times``: iteration 1's ready order, the time of each entry, and the backward's start (seconds, one clock).
    """
    link = probe_link(comm, params[0].device, sum(p.numel() * p.element_size() for p in params))
    ready_s = ready_seconds(len(params), *times)
    return choose_size_limits(params, order, ready_s, default_limits, link)


def probe_link(comm: Communicator, device: torch.device, grad_bytes: int) -> LinkCost:
    """Time all-reduces of 1 element and of ``grad_bytes`` clamped to ``PROBE_BYTES``. Every rank must call it."""
    small = torch.zeros(1, device=device)
    large = torch.zeros(min(max(grad_bytes, PROBE_BYTES[0]), PROBE_BYTES[1]) // 4, device=device)

    def best_of(tensor: torch.Tensor) -> float:
        return min(comm.timed_all_reduce(Op.LINK_PROBE, tensor) for _ in range(PROBE_REPEATS))

    latency = best_of(small)
    transfer = max(best_of(large) - latency, 1e-9)
    return LinkCost(latency, large.numel() * large.element_size() / transfer)


def ready_seconds(n: int, ready_order: Sequence[int], ready_times: Sequence[float], start: float) -> list[float]:
    """Seconds from backward start at which each of ``n`` gradients became ready; those never seen count as ready
    when the last one did."""
    seconds = [max(ready_times, default=start) - start] * n
    for i, t in zip(ready_order, ready_times):
        seconds[i] = t - start
    return seconds


def predict_finish(
    params: Sequence[torch.Tensor],
    order: Sequence[int],
    ready_s: Sequence[float],
    limits: Sequence[int],
    link: LinkCost,
) -> float:
    """Seconds from backward start until the last bucket's all-reduce ends, for buckets built with ``limits``.

    ``ready_s[i]`` is when ``params[i]``'s gradient became ready. Buckets launch in order, each once all of its
    gradients are ready and the previous one has launched, and the link carries one all-reduce at a time.
    """
    link_free = 0.0
    launched = 0.0
    for group in assign_buckets(params, order, limits):
        launched = max(launched, max(ready_s[i] for i in group))
        nbytes = sum(params[i].numel() * params[i].element_size() for i in group)
        link_free = max(launched, link_free) + link.seconds(nbytes)
    return max(link_free, max(ready_s, default=0.0))


def choose_size_limits(
    params: Sequence[torch.Tensor],
    order: Sequence[int],
    ready_s: Sequence[float],
    default_limits: Sequence[int],
    link: LinkCost,
) -> BucketTuning:
    """Propose byte limits (first bucket, others) for ``params`` bucketed in ``order`` (see the module docstring)."""
    default_s = predict_finish(params, order, ready_s, default_limits, link)
    candidates = {cap: _limits(cap) for cap in CANDIDATE_CAPS_MB}
    predicted = {cap: predict_finish(params, order, ready_s, limits, link) for cap, limits in candidates.items()}
    best = min(predicted.values())
    proposed = list(default_limits)
    if best <= default_s * (1 - MIN_GAIN):
        cap = max(c for c, seconds in predicted.items() if seconds <= best * (1 + TIE))
        proposed = candidates[cap]
    return BucketTuning(list(default_limits), list(default_limits), proposed, predicted, default_s, link)


def _limits(cap_mb: float) -> list[int]:
    cap = int(cap_mb * MIB)
    return [min(cap, buckets.DEFAULT_FIRST_BUCKET_BYTES), cap]  # torch's small first bucket: communication starts early
