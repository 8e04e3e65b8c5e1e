"""Variants timed side by side in one process group: each round runs every variant's step once, after a barrier,
the order reversed every other round so drift hits all alike; a step counts as its slowest rank's time."""

from __future__ import annotations

import resource
import time
from collections.abc import Callable

import torch
import torch.distributed as dist


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def time_interleaved(
    steps: dict[str, Callable[[], None]], warmup: int, count: int
) -> tuple[dict[str, list[float]], float]:
    """Each variant's ``count`` timed steps (seconds, the slowest rank's), after ``warmup`` untimed rounds; and the
    cores all ranks kept busy on average over the rounds (CPU seconds / wall seconds, summed over ranks)."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    cpu_before, wall_before = cpu_seconds(), time.perf_counter()
    for i in range(warmup + count):
        for name in names if i % 2 == 0 else names[::-1]:
            dist.barrier()
            start = time.perf_counter()
            steps[name]()
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
    busy = torch.tensor([(cpu_seconds() - cpu_before) / (time.perf_counter() - wall_before)], dtype=torch.float64)
    dist.all_reduce(busy)
    for name, ts in times.items():
        slowest = torch.tensor(ts, dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        times[name] = slowest.tolist()
    return times, busy.item()
