"""Cheap timestamps of one rank's steps, fed by the reducer and DDP (which cost nothing while none is attached).

Each step gets a :class:`StepRecord`: forward, backward and the wait for communication after it, the optimizer,
and for each bucket when it became ready, was launched, and completed. Times are wall-clock seconds
(``time.time()`` at attach + a monotonic offset), so ranks on different hosts line up in one trace; on a GPU they
are the GPU's times (CUDA events), placed on the same wall clock.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from gradsync.observe.clock import Clock, Mark, clock_for


@dataclasses.dataclass
class BucketRecord:
    index: int
    nbytes: int
    nparams: int
    ready: float = 0.0
    launch: float = 0.0
    done: float = 0.0


@dataclasses.dataclass
class StepRecord:
    forward_start: float = 0.0
    forward_end: float = 0.0
    backward_start: float = 0.0  # first gradient hook (the loss's own backward starts a little earlier)
    backward_end: float = 0.0  # autograd finished computing; waiting for communication starts
    comm_end: float = 0.0  # every bucket averaged and written back: .grad is final
    optimizer_start: float = 0.0
    optimizer_end: float = 0.0
    buckets: list[BucketRecord] = dataclasses.field(default_factory=list)


class Recorder:
    """The events DDP and the reducer report, in the order they happen in a step. This base ignores them all: it is
    what a model without a Monitor reports to, so the reducer never tests whether one is attached."""

    def forward_start(self) -> None: ...

    def forward_end(self) -> None: ...

    def backward_start(self, buckets: list) -> None: ...

    def bucket_ready(self, k: int) -> None: ...

    def bucket_launched(self, k: int, future: torch.futures.Future) -> None: ...

    def poll(self) -> None: ...

    def backward_end(self) -> None: ...

    def comm_end(self) -> None: ...


class StepRecorder(Recorder):
    """Receives events; keeps the last ``max_steps`` steps. Attach with :class:`gradsync.observe.Monitor`.

    Each event is a mark of ``device``'s clock (:mod:`gradsync.observe.clock`): on a GPU a CUDA event on the stream
    the work runs on, so the records are the GPU's timeline, not the host's launches. Marks are turned into wall
    times when their work is done: those finished are read at each step's start, the rest when :attr:`steps` is
    read (which then waits for them). A step's marks are placed on the wall clock from a mark made at its
    forward's start; a GPU running behind the host shifts the whole step, not its spans."""

    def __init__(self, max_steps: int = 10_000, device: torch.device | None = None, clock: Clock | None = None) -> None:
        self.max_steps = max_steps
        self._clock = clock or clock_for(device or torch.device("cpu"))
        self._steps: list[StepRecord] = []
        self._offset = time.time() - time.perf_counter()
        self._current: StepRecord | None = None
        self._anchor: tuple[Mark, float] = (self._clock.mark(), self.now())
        self._unread: list[tuple[object, str, Mark, tuple[Mark, float]]] = []
        self._in_flight: list[tuple[BucketRecord, torch.futures.Future]] = []

    @property
    def steps(self) -> list[StepRecord]:
        """The recorded steps, every mark read (on a GPU this waits for the work they mark)."""
        self._read(wait=True)
        return self._steps

    def now(self) -> float:
        return self._offset + time.perf_counter()

    def _stamp(self, record: object, field: str, mark: Mark | None = None) -> None:
        self._unread.append((record, field, self._clock.mark() if mark is None else mark, self._anchor))

    def _stamp_completion(self, record: BucketRecord, future: torch.futures.Future) -> None:
        try:
            mark = self._clock.mark_after(future)
        except Exception:  # a failed collective: the reducer's wait names it; its record stays without an end
            return
        self._stamp(record, "done", mark)

    def _read(self, wait: bool) -> None:
        unread = []
        for record, field, mark, (anchor, anchor_wall) in self._unread:
            if wait or (self._clock.done(anchor) and self._clock.done(mark)):
                setattr(record, field, anchor_wall + self._clock.seconds(anchor, mark))
            else:
                unread.append((record, field, mark, (anchor, anchor_wall)))
        self._unread = unread

    # --- DDP
    def forward_start(self) -> None:
        self._read(wait=False)
        self._current = StepRecord()
        self._anchor = (self._clock.mark(), self.now())
        self._stamp(self._current, "forward_start", self._anchor[0])
        self._steps.append(self._current)
        if len(self._steps) > self.max_steps:
            del self._steps[0]

    def forward_end(self) -> None:
        if self._current is not None:
            self._stamp(self._current, "forward_end")

    # --- reducer
    def backward_start(self, buckets: list) -> None:
        if self._current is None:
            return
        self._stamp(self._current, "backward_start")
        self._current.buckets = [BucketRecord(b.index, b.nbytes, len(b.param_indices)) for b in buckets]

    def bucket_ready(self, k: int) -> None:
        if self._current is not None and self._current.buckets:
            self._stamp(self._current.buckets[k], "ready")

    def bucket_launched(self, k: int, future: torch.futures.Future) -> None:
        if self._current is None or not self._current.buckets:
            return
        record = self._current.buckets[k]
        self._stamp(record, "launch")
        if future.done():  # NCCL's futures are, once enqueued: the completion is marked on the GPU
            self._stamp_completion(record, future)
        else:
            self._in_flight.append((record, future))

    def poll(self) -> None:
        """Mark the buckets whose all-reduce has finished. Polled from every gradient hook rather than a done
        callback: a Python callback held by a gloo future can be released during interpreter teardown, which
        aborts the process."""
        if not self._in_flight:
            return
        pending = []
        for record, future in self._in_flight:
            if future.done():
                self._stamp_completion(record, future)
            else:
                pending.append((record, future))
        self._in_flight = pending

    def backward_end(self) -> None:
        self.poll()
        if self._current is not None:
            self._stamp(self._current, "backward_end")

    def comm_end(self) -> None:
        for record, future in self._in_flight:  # finished during the final wait
            self._stamp_completion(record, future)
        self._in_flight = []
        if self._current is not None:
            self._stamp(self._current, "comm_end")

    # --- optimizer
    def optimizer_start(self) -> None:
        if self._current is not None:
            self._stamp(self._current, "optimizer_start")

    def optimizer_end(self) -> None:
        if self._current is not None:
            self._stamp(self._current, "optimizer_end")
