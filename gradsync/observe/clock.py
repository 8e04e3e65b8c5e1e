"""Timestamps of the work itself: the host's clock for CPU work, CUDA events on the stream for GPU work.

On a GPU the host only queues kernels and collectives: an NCCL future is done once its collective is enqueued, and
a gradient hook runs when its gradient's kernels were queued, not when they ran. Host times there are launch times,
and the bucket tuner and the Monitor would reason from numbers that are not the GPU's. So on CUDA a mark is a
timing event recorded on the current stream (the stream the marked work runs on: autograd runs a gradient's hook
with its stream current), and the time between two marks is the GPU's (``Event.elapsed_time``). Reading it waits
for the later event, so readers read marks late (the tuner at its next decision, the Monitor when asked), never
in the hot path.

Example::

    clock = clock_for(torch.device("cuda", 0))
    start = clock.mark()
    y = model(x)                             # queued on the current stream
    seconds = clock.seconds(start, clock.mark())
"""

from __future__ import annotations

import time
from typing import Any

import torch

# A mark: ``time.perf_counter()`` on the host, a recorded ``torch.cuda.Event`` on a GPU.
Mark = Any


class HostClock:
    """Marks are the host's ``perf_counter()``: the work a CPU model does happens when its Python call runs."""

    def mark(self) -> Mark:
        return time.perf_counter()

    def mark_after(self, future: torch.futures.Future) -> Mark:
        """When ``future`` (already done) completed: now, on the host."""
        return time.perf_counter()

    def done(self, mark: Mark) -> bool:
        return True

    def seconds(self, start: Mark, end: Mark) -> float:
        return end - start


class CudaClock:
    """Marks are timing events on ``device``'s current stream."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._side: torch.cuda.Stream | None = None  # where collectives' completions are marked (made at first use)

    def mark(self) -> Mark:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def mark_after(self, future: torch.futures.Future) -> Mark:
        """When the collective behind ``future`` (done on the host: enqueued) completes on the GPU.

        The mark is recorded on a side stream made to wait for the future (a CUDA future's ``wait`` orders the
        current stream after its events without blocking the host), so neither the host nor the compute stream
        waits for it: marking a bucket's completion must not take away the overlap it measures."""
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        with torch.cuda.stream(self._side):
            future.wait()
            return self.mark()

    def done(self, mark: Mark) -> bool:
        return bool(mark.query())

    def seconds(self, start: Mark, end: Mark) -> float:
        end.synchronize()
        return start.elapsed_time(end) / 1e3


Clock = HostClock | CudaClock


def clock_for(device: torch.device) -> Clock:
    """The clock that times work on ``device``."""
    return CudaClock(device) if device.type == "cuda" else HostClock()
