"""One synced backward, from the first gradient to ``.grad`` final: the path of one gradient, in order.

Li et al. (VLDB 2020, section 3.2): autograd accumulates ``param.grad`` and fires the parameter's hook, which calls
:meth:`BackwardStep.mark_ready`. A large gradient is copied into its bucket slot at once; when a bucket's last
gradient arrives, its small gradients are gathered in together and, if every earlier bucket has been launched, its
all-reduce (or communication hook) starts, while backward goes on computing earlier layers. At the end of backward
:meth:`BackwardStep.finish` waits for the buckets in order and writes the averages back.

A joined rank (``DistributedDataParallel.join``) runs the same object as a *shadow*: every bucket counts as ready
with zeros, so it issues exactly the collectives the training ranks issue, through the same code.

A step moves through its :class:`Phase` in one direction, by its own methods; the reducer reads the phase to pick
what a ready gradient does.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gradsync.collectives.communicator import Communicator, Op
from gradsync.errors import ConfigError, GradientError
from gradsync.observe.recorder import Recorder
from gradsync.reducer import messages
from gradsync.reducer.buckets import AnyBucket
from gradsync.reducer.layout import BucketLayout
from gradsync.reducer.reduction import BucketReduction
from gradsync.reducer.sparse_bucket import SparseBucket
from gradsync.reducer.static_graph import StaticGraph
from gradsync.reducer.unused import GlobalUsage


@dataclass(frozen=True)
class StepContext:
    """What every step of one reducer shares. The reducer builds a new one when an extension point changes (a comm
    hook, a recorder, a per-bucket callback), so a step never tests whether a feature is on."""

    names: Sequence[str]
    comm: Communicator
    reduction: BucketReduction  # launches a bucket: the built-in all-reduce or the registered comm hook
    static: StaticGraph | None  # static_graph=True's learned state; None otherwise
    usage: GlobalUsage
    recorder: Recorder
    bucket_reduced: Callable[[AnyBucket], None] | None  # hand each bucket on as soon as its averages are in .grad
    hear_late: Callable[[list[int]], None]  # quiet parameters that fired after their bucket's last: hook them again


class Phase(enum.Enum):
    """Where one synced backward is; it only moves down this list."""

    ARMED = "armed by a synced forward; no gradient yet"
    LEARNING = "static_graph's first backward: noting which parameters fire; every bucket reduces at its end"
    REDUCING = "gradients go into their buckets; full buckets launch in order"
    FINISHED = "the buckets were waited for: the averages are in .grad (or the step failed)"


class BackwardStep:
    """The state of one synced backward: which gradients are in, which buckets are launched, their futures."""

    def __init__(
        self,
        ctx: StepContext,
        layout: BucketLayout,
        scale: float = 1.0,
        shadow: bool = False,
        on_all_launched: Callable[[], None] | None = None,
        lend: bool = False,
    ) -> None:
        self.ctx = ctx
        self.lend = lend  # whether large averaged slots may be lent to .grad instead of copied (lending.py)
        self.layout = layout
        self.scale = scale  # applied to the averages (join with divide_by_initial_world_size=False)
        self.on_all_launched = on_all_launched  # the reducer queues the end-of-backward callback there
        self.ready = bytearray(len(ctx.names))
        used = ctx.usage.local_map()  # None unless this step all-reduces a usage map
        self.used = bytearray(len(used)) if shadow and used is not None else used  # a shadow used nothing
        self.pending = [b.hooked_count for b in layout.buckets]
        self.futures: list[torch.futures.Future] = []
        self.next_launch = 0
        self.phase = Phase.ARMED
        self._end_check_queued = False  # whether the end-of-backward check is queued on the autograd engine
        self.buffers = [torch.zeros_like(b.buffer) for b in layout.buckets] if shadow else None
        # Each bucket's averages go into .grad as soon as it is waited for (as torch's reducer does), so the copies
        # overlap the wait for later buckets; unused parameters (whose .grad stays untouched) make them wait for all.
        each_bucket = not shadow and (ctx.bucket_reduced is not None or ctx.usage.all_used_known())
        # Plain functions, called with the step: a bound method kept on the step would make a reference cycle, and
        # a finished step (with its layout's buffers) would then wait for the garbage collector to be freed.
        self._bucket_done = BackwardStep._hand_on if each_bucket else _ignore
        self._all_done = BackwardStep._write_back if not shadow and not each_bucket else _ignore_used
        # Hot-path lookups, bound once per step.
        self._take_of = layout.take_of
        self._slot_of = layout.slot_of
        self._bucket_index_of = layout.bucket_index_of
        self._reduction = ctx.reduction
        self._divisor = ctx.reduction.divisor

    # ------------------------------------------------------------------------------------------ its phase
    @property
    def finished(self) -> bool:
        return self.phase is Phase.FINISHED

    @property
    def unfinished(self) -> bool:
        """Started and not finished: a backward that did not get all its gradients (reported at the next step)."""
        return self.phase is Phase.LEARNING or self.phase is Phase.REDUCING

    def begin(self, learning: bool) -> None:
        """The first gradient arrived: learn (static_graph's first backward) or reduce."""
        self.phase = Phase.LEARNING if learning else Phase.REDUCING

    def end_learning(self) -> None:
        """static_graph's first backward ended: its gradients are now marked ready, launching every bucket."""
        self.phase = Phase.REDUCING

    def claim_end_check(self) -> bool:
        """True once: the caller queues the end-of-backward check (from the sink, or the first gradient)."""
        if self._end_check_queued or self.finished:
            return False
        self._end_check_queued = True
        return True

    # ------------------------------------------------------------------------------------ during backward
    def mark_ready(self, i: int) -> None:
        """Parameter ``i``'s gradient is final for this backward (its hook fired, or it is unused)."""
        if self.ready[i]:
            raise self._ready_twice(i)
        self.ready[i] = 1
        take = self._take_of[i]
        if take is not None:  # a large gradient: into its slot now, spreading the copying over backward
            take(self._slot_of[i], self._divisor)
        k = self._bucket_index_of[i]
        self.pending[k] -= 1
        if self.pending[k] == 0:
            self._bucket_filled(k)

    def _bucket_filled(self, k: int) -> None:
        bucket = self.layout.buckets[k]
        if bucket.quiet and not self._quiet_heard(k, bucket):
            return  # waiting for quiet parameters that fired late: their own hooks now report them
        bucket.gather_grads(self._divisor)
        self.ctx.recorder.bucket_ready(k)
        if k == self.next_launch:
            self._launch_ready()

    def _quiet_heard(self, k: int, bucket: AnyBucket) -> bool:
        """The last-ready hook stood for the quiet parameters (:func:`.buckets.quiet_parameters`): whether all of them
        fired. If the ready order changed, the ones still to come are handed to the reducer, which gives them their
        own hooks, and the bucket waits for them (so a changed order costs a wait, never a wrong average)."""
        late = [j for j in bucket.unheard() if not self.ready[j]]
        for j in bucket.quiet:
            self.ready[j] = 1
        if not late:
            return True
        for j in late:
            self.ready[j] = 0
        self.pending[k] = len(late)
        self.ctx.hear_late(late)
        return False

    def _launch_ready(self) -> None:
        # Strictly in bucket order: every rank must issue identical collectives in an identical sequence.
        buckets = self.layout.buckets
        while self.next_launch < len(buckets) and self.pending[self.next_launch] == 0:
            k = self.next_launch
            buffer, views = self._buffer_and_views(k)
            future = self._reduction.launch(k, buffer, views, buckets[k].params, k == len(buckets) - 1)
            self.futures.append(future)
            self.next_launch += 1
            self.ctx.recorder.bucket_launched(k, future)
        if self.next_launch == len(buckets):
            if self.used is not None and not self._reduction.one_at_a_time:
                self._start_usage()  # after the last bucket: it delays none
            if self.on_all_launched is not None:
                self.on_all_launched()

    def _start_usage(self) -> None:
        assert self.used is not None
        self.ctx.usage.start(self.used, self.layout.buckets[0].buffer.device)

    @property
    def all_launched(self) -> bool:
        return self.next_launch == len(self.layout.buckets)

    def _ready_twice(self, i: int) -> Exception:
        static = self.ctx.static
        if static is not None:
            return static.ready_twice(i, self.ctx.names)
        return GradientError(messages.ready_twice(self.ctx.names[i]))

    def missing(self) -> list[str]:
        """The parameters whose gradient has not arrived (a quiet one that fired counts as arrived)."""
        heard = self.layout.heard()
        return [name for i, (name, ready) in enumerate(zip(self.ctx.names, self.ready)) if not ready and i not in heard]

    def _buffer_and_views(self, k: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        bucket = self.layout.buckets[k]
        if self.buffers is None:
            return bucket.buffer, bucket.views
        zeros = self.buffers[k]
        if isinstance(bucket, SparseBucket):
            return zeros, [zeros]
        sizes = [v.numel() for v in bucket.views]
        return zeros, [piece.view_as(v) for piece, v in zip(zeros.split(sizes), bucket.views)]

    def launch_all_as_shadow(self) -> None:
        """A joined rank: every bucket is ready (with zeros) at once; nothing is used on this rank."""
        self.pending = [0] * len(self.pending)
        self._launch_ready()

    # ----------------------------------------------------------------------------------- end of backward
    def finish(self) -> None:
        """Wait for every bucket in order, then write the averages into ``.grad``."""
        self.phase = Phase.FINISHED
        if not self.all_launched:
            self.raise_not_ready(messages.unused_hint(False))
        bounded = self._reduction.needs_deadline
        for k, future in enumerate(self.futures):
            describe = lambda k=k: f"all-reduce of {self.describe_bucket(k)}"  # noqa: E731 (built only on failure)
            result: Any = self.ctx.comm.wait(future, Op.BUCKET_ALLREDUCE, k, describe, bounded=bounded)
            if isinstance(result, list):  # the built-in all-reduce's future holds [tensor]
                result = result[0]
            self._check_result(k, result)
            if self.buffers is None:  # a shadow's results are zeros from everyone else: nothing to keep
                self.layout.buckets[k].receive(result)
                self._bucket_done(self, self.layout.buckets[k])
        if self.used is not None and self._reduction.one_at_a_time:
            self._start_usage()  # only now: the hooks issue collectives from other threads until they complete
        # Hold no finished futures past this point: gloo work objects that outlive the process group are destroyed
        # during interpreter teardown and abort the process ("terminate called ...").
        self.futures = []
        self._all_done(self, self.ctx.usage.result())

    def _check_result(self, k: int, result: Any) -> None:
        bucket = self.layout.buckets[k]
        if isinstance(result, torch.Tensor) and (result.is_sparse or result.numel() == bucket.buffer.numel()):
            return
        got = f"a tensor of {result.numel()} elements" if isinstance(result, torch.Tensor) else type(result).__name__
        raise ConfigError(
            f"the communication hook's future for {self.describe_bucket(k)} holds {got}; it must hold the bucket's "
            f"averaged gradients, a tensor of {bucket.buffer.numel()} elements (bucket.buffer()'s size)."
        )

    def _hand_on(self, bucket: AnyBucket) -> None:
        self.layout.write_back_bucket(bucket, self.scale, self.lend)
        if self.ctx.bucket_reduced is not None:
            self.ctx.bucket_reduced(bucket)

    def _write_back(self, globally_used: list[int] | None) -> None:
        self.layout.write_back(globally_used, self.scale)

    def describe_bucket(self, k: int) -> str:
        return messages.bucket_description(self.layout.buckets[k], len(self.layout.buckets), self.ctx.names)

    def raise_not_ready(self, hint: str) -> None:
        """The backward ended with gradients missing: name them on every rank (posted for the others through the
        communicator) and stop."""
        message = messages.no_gradient(self.ctx.comm.rank, self.missing(), hint)
        self.ctx.comm.report(message)
        raise GradientError(message)


def _ignore(_step: BackwardStep, _bucket: AnyBucket) -> None:
    pass


def _ignore_used(_step: BackwardStep, _globally_used: list[int] | None) -> None:
    pass
