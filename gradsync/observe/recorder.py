"""Cheap timestamps of one rank's steps, fed by the reducer and DDP (which cost nothing while none is attached).

Each step gets a :class:`StepRecord`: forward, backward and the wait for communication after it, the optimizer,
and for each bucket when it became ready, was launched, and completed. Times are wall-clock seconds
(``time.time()`` at attach + a monotonic offset), so ranks on different hosts line up in one trace.
"""

from __future__ import annotations

import dataclasses
import time

import torch


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
    """Receives events; keeps the last ``max_steps`` steps. Attach with :class:`gradsync.observe.Monitor`."""

    def __init__(self, max_steps: int = 10_000) -> None:
        self.max_steps = max_steps
        self.steps: list[StepRecord] = []
        self._offset = time.time() - time.perf_counter()
        self._current: StepRecord | None = None
        self._in_flight: list[tuple[BucketRecord, torch.futures.Future]] = []

    def now(self) -> float:
        return self._offset + time.perf_counter()

    # --- DDP
    def forward_start(self) -> None:
        self._current = StepRecord(forward_start=self.now())
        self.steps.append(self._current)
        if len(self.steps) > self.max_steps:
            del self.steps[0]

    def forward_end(self) -> None:
        if self._current is not None:
            self._current.forward_end = self.now()

    # --- reducer
    def backward_start(self, buckets: list) -> None:
        if self._current is None:
            return
        self._current.backward_start = self.now()
        self._current.buckets = [BucketRecord(b.index, b.nbytes, len(b.param_indices)) for b in buckets]

    def bucket_ready(self, k: int) -> None:
        if self._current is not None and self._current.buckets:
            self._current.buckets[k].ready = self.now()

    def bucket_launched(self, k: int, future: torch.futures.Future) -> None:
        if self._current is None or not self._current.buckets:
            return
        self._current.buckets[k].launch = self.now()
        self._in_flight.append((self._current.buckets[k], future))

    def poll(self) -> None:
        """Stamp the buckets whose all-reduce has finished. Polled from every gradient hook rather than a done
        callback: a Python callback held by a gloo future can be released during interpreter teardown, which
        aborts the process."""
        if not self._in_flight:
            return
        now = self.now()
        pending = []
        for record, future in self._in_flight:
            if future.done():
                record.done = record.done or now
            else:
                pending.append((record, future))
        self._in_flight = pending

    def backward_end(self) -> None:
        self.poll()
        if self._current is not None:
            self._current.backward_end = self.now()

    def comm_end(self) -> None:
        if self._current is not None:
            self._current.comm_end = self.now()
            for b in self._current.buckets:  # finished during the final wait
                b.done = b.done or self._current.comm_end
        self._in_flight = []

    # --- optimizer
    def optimizer_start(self) -> None:
        if self._current is not None:
            self._current.optimizer_start = self.now()

    def optimizer_end(self) -> None:
        if self._current is not None:
            self._current.optimizer_end = self.now()
