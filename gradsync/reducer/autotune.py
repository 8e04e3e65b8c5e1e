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
4. the cap is changed only if it is predicted to save at least ``MIN_GAIN`` of backward + communication time, and
   among candidates within ``TIE`` of the best the largest wins (fewer buckets, fewer launches). Rank 0's choice
   travels in the rebuild broadcast, so every rank builds identical buckets.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from gradsync.peer_errors import named_collective
from gradsync.reducer.buckets import MIB, assign_buckets

log = logging.getLogger("gradsync")

CANDIDATE_CAPS_MB = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 25.0)
# The large probe: at least 1 MiB (else its time is mostly latency and the throughput estimate is noise), at most
# 4 MiB (~35 ms at 1 Gbit/s), and no more than the gradients themselves.
PROBE_BYTES = (1 * MIB, 4 * MIB)
PROBE_REPEATS = 3
MIN_GAIN = 0.05  # of the predicted backward + communication time under the default caps
TIE = 0.01


def tuning_enabled(bucket_cap_mb: object) -> bool:
    """``"auto"`` tunes; None (torch's default) tunes unless ``GRADSYNC_BUCKET_TUNING=0``; a number never does."""
    if bucket_cap_mb is None:
        return os.environ.get("GRADSYNC_BUCKET_TUNING", "1") != "0"
    return bucket_cap_mb == "auto"


@dataclass(frozen=True)
class LinkCost:
    """What one all-reduce of ``n`` bytes costs on this process group: ``latency_s + n / bytes_per_s``."""

    latency_s: float
    bytes_per_s: float

    def seconds(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bytes_per_s


@dataclass(frozen=True)
class BucketTuning:
    """The tuner's decision and its evidence (``ddp.reducer.tuning``), for logs and reports."""

    size_limits: list[int]
    predicted_s: dict[float, float]  # candidate cap (MiB) -> predicted end of the last all-reduce after backward start
    default_s: float
    link: LinkCost

    def describe(self) -> str:
        first, cap = (limit / MIB for limit in self.size_limits)
        chosen = self.predicted_s.get(cap, self.default_s)  # this rank's estimate for the caps that apply
        return (
            f"bucket cap {cap:g} MiB (first {first:g} MiB): backward + all-reduce predicted {chosen * 1e3:.1f} ms vs "
            f"{self.default_s * 1e3:.1f} ms with torch's fixed caps; link {self.link.bytes_per_s / 1e6:.0f} MB/s, "
            f"{self.link.latency_s * 1e3:.2f} ms per all-reduce"
        )


def tune(
    process_group: dist.ProcessGroup | None,
    params: Sequence[torch.Tensor],
    order: Sequence[int],
    times: tuple[Sequence[int], Sequence[float], float],
    default_limits: Sequence[int],
) -> BucketTuning:
    """Probe the link (every rank must call this) and choose caps for ``params`` bucketed in ``order``.

    ``times``: iteration 1's ready order, the perf_counter() of each entry, and the backward's start.
    """
    device = params[0].device
    with named_collective("link probe of the bucket-size tuner"):
        link = probe_link(process_group, device, sum(p.numel() * p.element_size() for p in params))
    ready_s = ready_seconds(len(params), *times)
    tuning = choose_size_limits(params, order, ready_s, default_limits, link)
    if dist.get_rank(process_group) == 0:
        log.info("gradsync: %s", tuning.describe())
    return tuning


def probe_link(process_group: dist.ProcessGroup | None, device: torch.device, grad_bytes: int) -> LinkCost:
    """Time all-reduces of 1 element and of ``grad_bytes`` clamped to ``PROBE_BYTES``. Every rank must call it."""
    small = torch.zeros(1, device=device)
    large = torch.zeros(min(max(grad_bytes, PROBE_BYTES[0]), PROBE_BYTES[1]) // 4, device=device)

    def best_of(tensor: torch.Tensor) -> float:
        best = float("inf")
        for _ in range(PROBE_REPEATS):
            _synchronize(device)
            start = time.perf_counter()
            dist.all_reduce(tensor, group=process_group)
            _synchronize(device)  # NCCL returns once enqueued; the time that matters is the stream's
            best = min(best, time.perf_counter() - start)
        return best

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
    """Pick byte limits (first bucket, others) for ``params`` bucketed in ``order`` (see the module docstring)."""
    default_s = predict_finish(params, order, ready_s, default_limits, link)
    candidates = {cap: _limits(cap) for cap in CANDIDATE_CAPS_MB}
    predicted = {cap: predict_finish(params, order, ready_s, limits, link) for cap, limits in candidates.items()}
    best = min(predicted.values())
    chosen = list(default_limits)
    if best <= default_s * (1 - MIN_GAIN):
        cap = max(c for c, seconds in predicted.items() if seconds <= best * (1 + TIE))
        chosen = candidates[cap]
    return BucketTuning(chosen, predicted, default_s, link)


def _limits(cap_mb: float) -> list[int]:
    cap = int(cap_mb * MIB)
    return [min(cap, MIB), cap]  # torch's small first bucket, so communication starts early


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
