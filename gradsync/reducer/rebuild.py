"""The one-time bucket rebuild after iteration 1, and the check of the bucket-size tuner's proposal with real steps.

Gradients become ready in execution order, not registration order; bucketing in that order lets each bucket
launch as early as possible (Li et al., VLDB 2020, section 3.2.3). So iteration 1 records the order, and at the next
synced forward (all ranks in step, memory lowest) the buckets are rebuilt in rank 0's order on every rank: their
collectives must match. Torch does the same and never rebuilds with a dynamic graph (find_unused_parameters).

With tuning on, the rebuild also proposes bucket caps from iteration 1's timeline (:mod:`.autotune`). A proposal is
a prediction, so it is checked before it is kept: the next ``2 * TRIAL_PAIRS`` synced steps alternate the proposed
layout and torch's, every rank switching at the same forward; rank 0 then keeps the proposal only if both the median
of its paired step-time ratios and the ratio of its median step times are at most ``1 - KEEP_MARGIN``, and
broadcasts that decision. Each step is timed from
its first gradient to ``.grad`` being final, which covers everything the layout changes (the copies, the
collectives, and the CPU they take from backward) and nothing it does not (forward, data, optimizer).

States, advanced identically on every rank (a joined rank's shadow steps advance them too)::

    NEVER (dynamic graph)   [WAITING ->] RECORDING -> PENDING -> [TRIAL -> DECIDING] -> DONE

WAITING is static_graph's iteration 1: torch's Reducer records no ready order while it learns the graph (its
all-reduce waits for the end of that backward), so it records iteration 2's and rebuilds before iteration 3.
"""

from __future__ import annotations

import dataclasses
import enum
import statistics
from collections.abc import Callable, Sequence

import torch

from gradsync.collectives.communicator import Communicator, Op
from gradsync.log import log
from gradsync.observe.clock import Clock, HostClock, Mark
from gradsync.reducer import autotune
from gradsync.reducer.buckets import MIB, BucketLayout, Storage, assign_buckets
from gradsync.reducer.caps import BucketCaps

TRIAL_PAIRS = 5  # synced steps under each layout, alternated
KEEP_MARGIN = 0.02  # the proposal must measure at least this much faster than torch's caps (this machine's noise)


class RebuildState(enum.Enum):
    NEVER = "no rebuild (dynamic graph)"
    WAITING = "static_graph's iteration 1: the ready order is recorded from iteration 2"
    RECORDING = "recording iteration 1's ready order"
    PENDING = "rebuild at the next synced forward"
    TRIAL = "alternating the proposed caps and torch's"
    DECIDING = "deciding at the next synced forward"
    DONE = "rebuilt"


class Trial:
    """Alternate two bucket caps, one synced step each, and time them (first gradient to ``.grad`` final).

    It holds the caps, not the layouts: each step's layout is built when it is due, after the reducer let go of the
    previous one, so the trial holds one layout's buffers at a time, as training does (two would be a second copy
    of every gradient at the peak)."""

    def __init__(self, proposed: list[int], default: list[int], pairs: int) -> None:
        self.limits = (proposed, default)
        self.marks: tuple[list[tuple[Mark, Mark]], list[tuple[Mark, Mark]]] = ([], [])
        self.steps = 2 * pairs
        self.taken = 0

    @property
    def complete(self) -> bool:
        return self.taken >= self.steps

    def next_limits(self) -> list[int]:
        return self.limits[self.taken % 2]

    def add(self, start: Mark, end: Mark) -> None:
        self.marks[self.taken % 2].append((start, end))
        self.taken += 1

    def result(self, clock: Clock) -> autotune.TrialResult:
        """This rank's measurements; the decision (``kept``) is rank 0's, see :meth:`Rebuild._decide`. The steps'
        marks are read here, at the decision, where waiting for them (on a GPU) costs the hot path nothing."""
        proposed, default = ([clock.seconds(*pair) for pair in marks] for marks in self.marks)
        ratios = [p / d for p, d in zip(proposed, default) if d > 0]
        ratio = _median(ratios, float("inf"))
        proposed_s, default_s = _median(proposed, 0.0), _median(default, 0.0)
        # Both the paired ratios and the plain medians must show the gain: on a noisy machine one alone can.
        kept = ratio <= 1 - KEEP_MARGIN and proposed_s <= default_s * (1 - KEEP_MARGIN)
        return autotune.TrialResult(len(ratios), proposed_s, default_s, ratio, kept)


class Rebuild:
    """Decides which :class:`BucketLayout` the reducer uses at each synced forward (see the module docstring)."""

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        comm: Communicator,
        first: BucketLayout,
        caps: BucketCaps,
        enabled: bool,
        clock: Clock | None = None,
        record_from_iteration_2: bool = False,
    ) -> None:
        self._params = params
        self._comm = comm
        self._clock = clock or HostClock()  # the device's: on a GPU the host's times are launch times
        self._limits = list(caps.limits)  # torch's rebuild uses the configured caps, whatever iteration 1 used
        # The rebuilt layouts keep iteration 1's view mode and sparse parameters; the layout itself is not kept, so
        # its buffers are freed once the reducer lets go of it (a whole copy of the gradients otherwise).
        self._as_view, self._sparse, self._grad_dtype = first.as_view, first.sparse, first.grad_dtype
        self._tune = caps.tune
        initial = RebuildState.WAITING if record_from_iteration_2 else RebuildState.RECORDING
        self.state = initial if enabled else RebuildState.NEVER
        self.tuning: autotune.BucketTuning | None = None
        self.local_order: list[int] = []  # this rank's observed ready order (iteration 1)
        self._ready_marks: list[Mark] = []
        self._backward_start: Mark = None
        self._trial: Trial | None = None
        self._order: list[int] = []  # the rebuilt order, rank 0's (every layout from the rebuild on uses it)
        self._final_limits: list[int] = []  # the caps kept, once DONE

    def disable_tuning(self) -> None:
        """Keep the configured caps at the rebuild: no probe, no proposal, no trial (a stateful comm hook)."""
        self._tune = False

    @property
    def recording(self) -> bool:
        return self.state is RebuildState.RECORDING

    @property
    def done(self) -> bool:
        return self.state is RebuildState.DONE

    def record(self, index: int) -> None:
        """Iteration 1: parameter ``index``'s gradient is ready now (marked on the stream that computed it)."""
        self.local_order.append(index)
        self._ready_marks.append(self._clock.mark())

    def backward_started(self) -> None:
        """A synced backward's first gradient (or a joined rank's shadow) is here: the timed span starts."""
        if self.state is RebuildState.RECORDING or self.state is RebuildState.TRIAL:
            self._backward_start = self._clock.mark()

    def backward_done(self) -> None:
        """A synced backward (or a joined rank's shadow of one) ended: every ``.grad`` is final."""
        if self.state is RebuildState.WAITING:
            self.state = RebuildState.RECORDING
        elif self.state is RebuildState.RECORDING:
            self.state = RebuildState.PENDING
        elif self.state is RebuildState.TRIAL and self._trial is not None:
            self._trial.add(self._backward_start, self._clock.mark())
            if self._trial.complete:
                self.state = RebuildState.DECIDING

    def before_forward(self, release: Callable[[], Storage | None] = lambda: None) -> BucketLayout | None:
        """The layout to use from this synced forward on, or None to keep the current one. Every rank calls it at
        the same forward (a collective when the state says so). ``release()`` is called before a new layout is
        built, for the caller to let go of the current one; the storage it returns, if any, is the new layout's."""
        if self.state is RebuildState.PENDING:
            return self._rebuild(release)
        if self.state is RebuildState.TRIAL and self._trial is not None:
            return self._layout(self._order, self._trial.next_limits(), release())
        if self.state is RebuildState.DECIDING:
            return self._decide(release)
        return None

    def _rebuild(self, release: Callable[[], Storage | None]) -> BucketLayout:
        seen = set(self.local_order)
        order = self.local_order + [i for i in reversed(range(len(self._params))) if i not in seen]
        proposed = self._limits
        if self._worth_tuning():  # every rank probes; rank 0's proposal is the one broadcast
            ready_s = [self._clock.seconds(self._backward_start, mark) for mark in self._ready_marks]
            times = (self.local_order, ready_s, 0.0)
            self.tuning = autotune.tune(self._comm, self._params, order, times, self._limits)
            proposed = self.tuning.proposed_limits
        plan = torch.tensor(order + proposed, dtype=torch.int64, device=self._params[0].device)
        self._comm.broadcast(Op.PLAN_BROADCAST, plan)
        values = plan.tolist()
        order, proposed = values[: len(order)], values[len(order) :]
        if self.tuning is not None:
            self.tuning = dataclasses.replace(self.tuning, proposed_limits=proposed)
        self._order = order
        if proposed != self._limits and not self._same_buckets(order, proposed, self._limits):
            self._trial = Trial(proposed, self._limits, TRIAL_PAIRS)
            self.state = RebuildState.TRIAL
            return self._layout(order, self._trial.next_limits(), release())
        default = self._layout(order, self._limits, release())
        self._finish(default)
        return default

    def _same_buckets(self, order: list[int], limits: list[int], other: list[int]) -> bool:
        """Whether two caps group the parameters identically (then there is nothing to try)."""
        return assign_buckets(self._params, order, limits, self._sparse) == assign_buckets(
            self._params, order, other, self._sparse
        )

    def _worth_tuning(self) -> bool:
        """No probe (no extra collective a profiler would count) where no candidate cap could split the gradients:
        a group of one, or gradients no larger than the smallest candidate. Parameter sizes are the same on every
        rank (checked at construction), so every rank decides alike."""
        grad_bytes = sum(p.numel() * p.element_size() for p in self._params)
        smallest = min(autotune.CANDIDATE_CAPS_MB) * MIB
        return self._tune and self._comm.size > 1 and grad_bytes > smallest

    def _layout(self, order: list[int], limits: list[int], storage: Storage | None = None) -> BucketLayout:
        return BucketLayout(
            self._params, order, limits, self._as_view, self._sparse, storage, grad_dtype=self._grad_dtype
        )

    def _decide(self, release: Callable[[], Storage | None]) -> BucketLayout:
        assert self._trial is not None
        mine = self._trial.result(self._clock)
        device = self._params[0].device
        evidence = [float(mine.kept), mine.proposed_s, mine.default_s, mine.ratio, float(mine.pairs)]
        message = torch.tensor(evidence, dtype=torch.float64, device=device)
        self._comm.broadcast(Op.TRIAL_DECISION, message)  # rank 0's measurements and decision, on every rank
        kept, proposed_s, default_s, ratio, pairs = message.tolist()
        result = autotune.TrialResult(int(pairs), proposed_s, default_s, ratio, bool(kept))
        winner_limits = self._trial.limits[0 if result.kept else 1]
        if self.tuning is not None:
            self.tuning = dataclasses.replace(self.tuning, trial=result)
        self._trial = None
        winner = self._layout(self._order, winner_limits, release())
        self._finish(winner)
        return winner

    def decided(self) -> tuple[list[int], list[int]] | None:
        """The rebuilt order and the caps kept, once final; None before."""
        return (list(self._order), list(self._final_limits)) if self.state is RebuildState.DONE else None

    def adopt(self, decided: tuple[list[int], list[int]], release: Callable[[], Storage | None]) -> BucketLayout:
        """Start from another reducer's :meth:`decided` layout (rank 0's, for the same model): nothing to learn."""
        order, limits = decided
        if sorted(order) != list(range(len(self._params))):
            raise ValueError(f"a decided bucket order for {len(self._params)} parameters, got one of {len(order)}")
        self._order, self.local_order = list(order), list(order)
        layout = self._layout(self._order, list(limits), release())
        self._finish(layout)
        return layout

    def _finish(self, layout: BucketLayout) -> None:
        self.state = RebuildState.DONE
        self._final_limits = list(layout.limits)
        if self.tuning is not None:
            self.tuning = dataclasses.replace(self.tuning, size_limits=layout.limits)
            if self._comm.rank == 0:
                log.info("gradsync: %s", self.tuning.describe())


def _median(values: Sequence[float], empty: float) -> float:
    return statistics.median(values) if values else empty
