"""One synced backward, from a parameter's hook to ``.grad`` final: the path of one gradient, in order.

Li et al. (VLDB 2020, section 3.2): autograd accumulates ``param.grad`` and fires the parameter's hook
(:class:`GradientHooks`), which calls the reducer, which calls :meth:`BackwardStep.mark_ready`. A large gradient is
copied into its bucket slot at once; when a bucket's last gradient arrives, its small gradients are gathered in
together and, if every earlier bucket has been launched, its reduction starts (:class:`AllReduce`, or a
communication hook through :class:`HookReduction`), while backward goes on computing earlier layers. At the end of
backward :meth:`BackwardStep.finish` waits for the buckets in order and writes the averages back. Where each
gradient goes is :mod:`.buckets`' business; the collectives are the communicator's.

Once the ready order is known, most hooks are *quiet* (:class:`GradientHooks`): a C function that only notes that
the gradient was accumulated, the bucket's last-ready parameter's own hook standing for the rest.

A joined rank (``DistributedDataParallel.join``) runs the same step as a *shadow*: every bucket counts as ready
with zeros, so it issues exactly the collectives the training ranks issue, through the same code.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from gradsync import torch_private
from gradsync.collectives.communicator import Communicator, Op
from gradsync.errors import ConfigError, GradientError
from gradsync.observe.recorder import Recorder
from gradsync.reducer import messages
from gradsync.reducer.buckets import AnyBucket, Bucket, BucketLayout
from gradsync.reducer.grad_bucket import GradBucket, result_future
from gradsync.reducer.hook_order import OneAtATime, hook_needs_order
from gradsync.reducer.sparse_bucket import SparseBucket
from gradsync.reducer.static_graph import StaticGraph
from gradsync.reducer.unused import GlobalUsage

CommHook = Callable[[Any, GradBucket], torch.futures.Future]


# ----------------------------------------------------------------------------------------------------- the hooks
class GradientHooks:
    """Each parameter's hook on its gradient: *loud*, a Python function called with the parameter's index, or
    *quiet*, its bucket's ``deque.append`` (a C function: no Python frame runs).

    A loud hook is a post hook of the parameter's gradient accumulator (autograd's AccumulateGrad node), as torch's
    reducer registers it (``Reducer::Reducer``, ``add_post_hook``): it runs once the gradient is accumulated and after
    every hook of the parameter's own, so the bucket gets what those hooks left in ``.grad``.

    Quiet hooks: autograd's engine runs the same graph in the same order every time, so once a bucket's last-ready
    parameter fires, every earlier one has usually accumulated its gradient. That one hook stands for the others,
    which only note that they fired; :meth:`_QuietSet.unheard` checks the notes, so a changed order costs a wait,
    never a wrong average, and from then on every hook is loud. Saves one Python call per quiet parameter per
    backward.
    """

    def __init__(self, params: Sequence[torch.Tensor], loud: Callable[[int], Callable[[Any, Any], None]]) -> None:
        self._params = params  # the hooked tensors (a DTensor itself, not its shard)
        self._loud = loud
        # Each gradient accumulator, held so that its hooks stay (the parameter holds it only weakly).
        self._accumulators = [torch.autograd.graph.get_gradient_edge(p).node for p in params]
        self._handles = [self._accumulators[i].register_hook(loud(i)) for i in range(len(params))]
        self._bucket_of: list[int | None] = [None] * len(params)  # the bucket a quiet parameter notes into
        self._quiet: dict[int, _QuietSet] = {}  # by bucket index, in the current layout
        self.order_changed = False  # a quiet parameter fired after its bucket's last: every hook stays loud

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._accumulators = []

    def quiet_down(self, layout: BucketLayout, order: Sequence[int]) -> None:
        """Per dense bucket of ``layout``, every parameter but the last-ready one in ``order`` gets a quiet hook.
        With gradient_as_bucket_view the large ones stay loud: each moves its gradient into its slot as it is
        ready, and so frees its memory."""
        position = {i: k for k, i in enumerate(order)}
        quiet: dict[int, _QuietSet] = {}
        for bucket in layout.dense:
            last = max(bucket.param_indices, key=position.__getitem__)
            slots = [s for s, i in enumerate(bucket.param_indices) if i != last]
            if layout.as_view:
                slots = [s for s in slots if s >= bucket.n_large]
            if slots:
                quiet[bucket.index] = _QuietSet(bucket, slots)
        self._rehook(quiet)

    def all_loud(self) -> None:
        self._rehook({})

    def _rehook(self, quiet: dict[int, _QuietSet]) -> None:
        now: list[int | None] = [None] * len(self._params)
        for bucket_index, group in quiet.items():
            for i in group.indices:
                now[i] = bucket_index
        for i, k in enumerate(now):
            if k is None and self._bucket_of[i] is not None:
                self._make_loud(i)
            elif k is not None:
                self._handles[i].remove()
                self._handles[i] = self._params[i].register_post_accumulate_grad_hook(quiet[k].heard.append)
        self._bucket_of, self._quiet = now, quiet

    def quiet_in(self, k: int) -> _QuietSet | None:
        """Bucket ``k``'s quiet parameters, if it has any."""
        return self._quiet.get(k)

    def quiet_count(self) -> int:
        return sum(len(group.indices) for group in self._quiet.values())

    def hooked_count(self, bucket: AnyBucket) -> int:
        """How many of ``bucket``'s parameters report through their own hook."""
        group = self._quiet.get(bucket.index)
        return len(bucket.param_indices) - (len(group.indices) if group is not None else 0)

    def clear_heard(self) -> None:
        """A new backward starts: no quiet parameter has fired yet."""
        for group in self._quiet.values():
            group.heard.clear()

    def heard(self) -> set[int]:
        """The quiet parameters that fired since :meth:`clear_heard`, as indices (for error messages)."""
        return {i for group in self._quiet.values() for i in set(group.indices).difference(group.unheard())}

    def hear_late(self, late: list[int]) -> None:
        """Quiet parameters fired after their bucket's last-ready one: the ready order changed. From now on every
        parameter has its own hook (the late ones at once, so they report in this backward; the rest at the next
        forward, as their buckets still count on their notes in this one)."""
        self.order_changed = True
        for i in late:
            self._make_loud(i)

    def _make_loud(self, i: int) -> None:
        self._handles[i].remove()
        self._handles[i] = self._accumulators[i].register_hook(self._loud(i))

    def speak_up_if_order_changed(self) -> None:
        """Before a synced backward: after a changed order, every hook is loud."""
        if self.order_changed and self._quiet:
            self.all_loud()


class _QuietSet:
    """One bucket's quiet parameters: their indices, the tensors their hooks note, and the notes. The notes are
    bounded: those of backwards no synced forward clears (a second wrapper of the same module training) cannot pile
    up."""

    def __init__(self, bucket: Bucket, slots: list[int]) -> None:
        self.indices = [bucket.param_indices[s] for s in slots]
        self.tensors = [bucket.params[s] for s in slots]
        self.large_slots = [s for s in slots if s < bucket.n_large]  # copied in with the small ones, at the gather
        self.heard: collections.deque[torch.Tensor] = collections.deque(maxlen=len(slots))

    def unheard(self) -> list[int]:
        """The quiet parameters whose gradient has not been accumulated since the notes were last cleared.

        Autograd runs each parameter's hook once per backward, so when the count matches, every one of them has
        fired (the fast path: no per-parameter work). Otherwise name the missing ones by identity."""
        if len(self.heard) == len(self.indices):
            return []
        heard = {id(t) for t in self.heard}
        return [i for i, t in zip(self.indices, self.tensors) if id(t) not in heard]


# ------------------------------------------------------------------------------------------- how a bucket reduces
class AllReduce:
    """The built-in reduction: gradients are divided by the world size on their way into the bucket, then one plain
    sum (torch's C++ default path)."""

    needs_deadline = False  # the backend's own timeout bounds the collective
    one_at_a_time = False  # one collective a bucket, issued here

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm
        self.divisor: int | None = comm.size  # what each gradient is divided by as it enters its bucket

    def launch(
        self, k: int, buffer: torch.Tensor, views: list[torch.Tensor], params: list[torch.Tensor], is_last: bool
    ) -> torch.futures.Future:
        return self.comm.all_reduce_async(Op.BUCKET_ALLREDUCE, buffer, index=k)

    def identity(self) -> str:
        """What every rank must agree on (compared once, at the first synced backward)."""
        return messages.hook_identity(None, None)


@dataclasses.dataclass(frozen=True)
class ReducePrecision:
    """Mixed precision's reduction (``DistributedDataParallel(mixed_precision=...)``): buckets hold ``dtype``
    (None: the gradients' own), and the built-in reduction sums them and then divides by the world size in that
    dtype, torch's arithmetic under mixed precision (``_reducer_allreduce_and_upcast_hook``); the averages are
    written, upcast, into each parameter's ``.grad``."""

    dtype: torch.dtype | None


class SumThenDivide(AllReduce):
    """The built-in reduction under mixed precision: one plain sum in the bucket's dtype, then a division by the
    world size in that dtype (torch's ``_reducer_allreduce_and_upcast_hook``: ``fut.wait(); buffer.div_(size)``),
    where gradsync's default divides on the way into the bucket."""

    def __init__(self, comm: Communicator) -> None:
        super().__init__(comm)
        self.divisor = None

    def launch(
        self, k: int, buffer: torch.Tensor, views: list[torch.Tensor], params: list[torch.Tensor], is_last: bool
    ) -> torch.futures.Future:
        size = self.comm.size
        summed = self.comm.all_reduce_async(Op.BUCKET_ALLREDUCE, buffer, index=k)
        return summed.then(lambda future: future.value()[0].div_(size))

    def identity(self) -> str:
        return "no comm hook (the built-in all-reduce, mixed precision: sum, then divide)"


def built_in_reduction(comm: Communicator, precision: ReducePrecision | None) -> AllReduce:
    """The reduction without a comm hook: gradsync's, or torch's mixed-precision arithmetic."""
    return AllReduce(comm) if precision is None else SumThenDivide(comm)


class HookReduction:
    """A communication hook reduces each bucket (torch's ``register_comm_hook`` contract: ``hook(state, bucket)``
    returns a ``Future[Tensor]`` of the bucket's averages); it averages itself, as torch's hooks do, so nothing is
    divided on the way in."""

    needs_deadline = True  # a hook's future is the hook's own: bounded by the process group's timeout here

    def __init__(self, comm: Communicator, state: Any, hook: CommHook) -> None:
        self.comm, self.state, self.hook = comm, state, hook
        self.divisor: int | None = None
        # On gloo, a hook that issues collectives from its futures' callbacks (PowerSGD) runs a bucket at a time.
        self.one_at_a_time = hook_needs_order(hook, comm.futures_complete_when_issued())
        self._order = OneAtATime()

    def launch(
        self, k: int, buffer: torch.Tensor, views: list[torch.Tensor], params: list[torch.Tensor], is_last: bool
    ) -> torch.futures.Future:
        bucket = GradBucket(k, buffer, views, params, is_last)  # a fresh one each launch: hooks may set_buffer()
        if not self.one_at_a_time:
            return self._start(bucket)
        return self._order.start(lambda: self._start(bucket), lambda: result_future(buffer.device))

    def _start(self, bucket: GradBucket) -> torch.futures.Future:
        k, buffer = bucket.index(), bucket.buffer()
        future = self.comm.launch(Op.BUCKET_ALLREDUCE, k, buffer, lambda: self.hook(self.state, bucket))
        if not torch_private.is_torch_future(future):  # torch.futures.Future and what .then() returns
            raise ConfigError(
                f"communication hook {getattr(self.hook, '__name__', self.hook)!r} returned "
                f"{type(future).__name__} for bucket {k}; it must return a torch.futures.Future[torch.Tensor]."
            )
        return future

    def identity(self) -> str:
        return messages.hook_identity(self.hook, self.state)


class FiniteChecked:
    """``check_for_nan_in_grad=True`` (Megatron's name): before each bucket's collective, one fused reduction over
    the whole bucket says whether its gradients are all finite (one host sync per bucket, not per parameter). A NaN
    or inf is named, with the first parameter holding one and this rank, before it is averaged into every replica;
    the other ranks, waiting in that bucket's collective, learn the cause from this rank's report. Wraps the bucket's
    reduction, so without the option nothing is checked and nothing is paid."""

    def __init__(self, inner: AllReduce | HookReduction, names: dict[int, str]) -> None:
        self.inner, self._names = inner, names  # names: id(parameter tensor) -> its name
        self.comm = inner.comm
        self.divisor = inner.divisor
        self.needs_deadline = inner.needs_deadline
        self.one_at_a_time = inner.one_at_a_time

    def launch(
        self, k: int, buffer: torch.Tensor, views: list[torch.Tensor], params: list[torch.Tensor], is_last: bool
    ) -> torch.futures.Future:
        if not bool(torch.isfinite(buffer).all()):
            first = next((p for v, p in zip(views, params) if not bool(torch.isfinite(v).all())), params[0])
            message = messages.non_finite_gradient(self.comm.rank, self._names.get(id(first), "?"), k)
            self.comm.report(message)
            raise GradientError(message)
        return self.inner.launch(k, buffer, views, params, is_last)

    def identity(self) -> str:
        return self.inner.identity()


BucketReduction = AllReduce | HookReduction | FiniteChecked


def checked_if(check: dict[int, str] | None, reduction: AllReduce | HookReduction) -> BucketReduction:
    """``reduction``, behind the non-finite check where ``check`` (the parameters' names by tensor id) is given."""
    return reduction if check is None else FiniteChecked(reduction, check)


# ------------------------------------------------------------------------------------------------------- the step
@dataclasses.dataclass(frozen=True)
class StepContext:
    """What every step of one reducer shares. The reducer builds a new one when an extension point changes (a comm
    hook, a recorder, a per-bucket callback)."""

    names: Sequence[str]
    comm: Communicator
    reduction: BucketReduction  # launches a bucket: the built-in all-reduce or the registered comm hook
    static: StaticGraph | None  # static_graph=True's learned state; None otherwise
    usage: GlobalUsage
    recorder: Recorder
    bucket_reduced: Callable[[AnyBucket], None] | None  # hand each bucket on as soon as its averages are in .grad
    hooks: GradientHooks


class BackwardPhase(enum.Enum):
    """Where one synced backward is; it only moves down this list, by :class:`BackwardStep`'s own methods."""

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
        self.lend = lend  # whether large averaged slots may be lent to .grad instead of copied (buckets.Lending)
        self.layout = layout
        self.scale = scale  # applied to the averages (join with divide_by_initial_world_size=False)
        self.on_all_launched = on_all_launched  # the reducer queues the end-of-backward callback there
        self.ready = bytearray(len(ctx.names))
        used = ctx.usage.local_map()  # None unless this step all-reduces a usage map
        self.used = bytearray(len(used)) if shadow and used is not None else used  # a shadow used nothing
        self.pending = [ctx.hooks.hooked_count(b) for b in layout.buckets]
        self.futures: list[torch.futures.Future] = []
        self.next_launch = 0
        self.phase = BackwardPhase.ARMED
        self._end_check_queued = False  # whether the end-of-backward check is queued on the autograd engine
        self.buffers = [torch.zeros_like(b.buffer) for b in layout.buckets] if shadow else None
        self.shadow = shadow
        # Each bucket's averages go into .grad as soon as it is waited for (as torch's reducer does), so the copies
        # overlap the wait for later buckets; unused parameters (whose .grad stays untouched) make them wait for all.
        self.each_bucket = not shadow and (ctx.bucket_reduced is not None or ctx.usage.all_used_known())
        self._divisor = ctx.reduction.divisor

    # ------------------------------------------------------------------------------------------ its phase
    @property
    def finished(self) -> bool:
        return self.phase is BackwardPhase.FINISHED

    @property
    def unfinished(self) -> bool:
        """Started and not finished: a backward that did not get all its gradients (reported at the next step)."""
        return self.phase is BackwardPhase.LEARNING or self.phase is BackwardPhase.REDUCING

    def begin(self, learning: bool) -> None:
        """The first gradient arrived: learn (static_graph's first backward) or reduce."""
        self.phase = BackwardPhase.LEARNING if learning else BackwardPhase.REDUCING

    def end_learning(self) -> None:
        """static_graph's first backward ended: its gradients are now marked ready, launching every bucket."""
        self.phase = BackwardPhase.REDUCING

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
        layout = self.layout
        k = layout.bucket_of[i]
        if layout.large_of[i]:  # into its slot now, spreading the copying over backward
            layout.buckets[k].take(layout.slot_of[i], self._divisor)
        self.pending[k] -= 1
        if self.pending[k] == 0:
            self._bucket_filled(k)

    def _bucket_filled(self, k: int) -> None:
        bucket = self.layout.buckets[k]
        quiet = self.ctx.hooks.quiet_in(k)
        if quiet is None:
            bucket.gather(self._divisor)
        elif self._quiet_heard(k, quiet):
            bucket.gather(self._divisor, quiet.large_slots)
        else:
            return  # waiting for quiet parameters that fired late: their own hooks now report them
        self.ctx.recorder.bucket_ready(k)
        if k == self.next_launch:
            self._launch_ready()

    def _quiet_heard(self, k: int, quiet: _QuietSet) -> bool:
        """The last-ready hook stood for the quiet parameters: whether all of them fired. If the ready order
        changed, the ones still to come get their own hooks, and the bucket waits for them."""
        late = [j for j in quiet.unheard() if not self.ready[j]]
        for j in quiet.indices:
            self.ready[j] = 1
        if not late:
            return True
        for j in late:
            self.ready[j] = 0
        self.pending[k] = len(late)
        self.ctx.hooks.hear_late(late)
        return False

    def _launch_ready(self) -> None:
        # Strictly in bucket order: every rank must issue identical collectives in an identical sequence.
        buckets = self.layout.buckets
        reduction = self.ctx.reduction
        while self.next_launch < len(buckets) and self.pending[self.next_launch] == 0:
            k = self.next_launch
            buffer, views = self._buffer_and_views(k)
            future = reduction.launch(k, buffer, views, buckets[k].params, k == len(buckets) - 1)
            self.futures.append(future)
            self.next_launch += 1
            self.ctx.recorder.bucket_launched(k, future)
        if self.next_launch == len(buckets):
            if self.used is not None and not reduction.one_at_a_time:
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
        heard = self.ctx.hooks.heard()
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
        self.phase = BackwardPhase.FINISHED
        if not self.all_launched:
            self.raise_not_ready(messages.unused_hint(False))
        bounded = self.ctx.reduction.needs_deadline
        for k, future in enumerate(self.futures):
            describe = lambda k=k: f"all-reduce of {self.describe_bucket(k)}"  # noqa: E731 (built only on failure)
            result: Any = self.ctx.comm.wait(future, Op.BUCKET_ALLREDUCE, k, describe, bounded=bounded)
            if isinstance(result, list):  # the built-in all-reduce's future holds [tensor]
                result = result[0]
            self._check_result(k, result)
            if not self.shadow:  # a shadow's results are zeros from everyone else: nothing to keep
                bucket = self.layout.buckets[k]
                bucket.receive(result)
                if self.each_bucket:
                    self._hand_on(bucket)
        if self.used is not None and self.ctx.reduction.one_at_a_time:
            self._start_usage()  # only now: the hooks issue collectives from other threads until they complete
        # Hold no finished futures past this point: gloo work objects that outlive the process group are destroyed
        # during interpreter teardown and abort the process ("terminate called ...").
        self.futures = []
        globally_used = self.ctx.usage.result()
        if not self.shadow and not self.each_bucket:
            self.layout.write_back(globally_used, self.scale)

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

    def describe_bucket(self, k: int) -> str:
        return messages.bucket_description(self.layout.buckets[k], len(self.layout.buckets), self.ctx.names)

    def raise_not_ready(self, hint: str) -> None:
        """The backward ended with gradients missing: name them on every rank (posted for the others through the
        communicator) and stop."""
        message = messages.no_gradient(self.ctx.comm.rank, self.missing(), hint)
        self.ctx.comm.report(message)
        raise GradientError(message)


# ------------------------------------------------------------------------------------- nested (reentrant) backward
def current_graph_task() -> int:
    """The autograd engine's id for the backward now running (-1 outside one, or where torch cannot say)."""
    return torch_private.current_graph_task_id()


def inside_nested_backward(caller_thread: int) -> bool:
    """Whether the backward now ending runs inside another one (reentrant checkpointing calls backward from a
    Function's backward). Then more gradients of the outer backward may still come.

    Counted by the ``_engine_run_backward`` frames on this thread. The thread that called the outermost backward
    (``caller_thread``, the forward's: torch's CPU engine runs the graph there) holds one frame for it, so a second
    means nested. Any other thread is an autograd device thread (a GPU's): the engine started it, so no frame of
    the outermost backward is on it, and one frame means a reentrant backward runs there. Counting one frame as
    nested everywhere would make every CUDA backward look nested, and a missing gradient would be reported a step
    late.
    """
    depth = 0
    frame = sys._getframe()
    while frame is not None:
        depth += frame.f_code.co_name == torch_private.ENGINE_RUN_BACKWARD_FRAME
        frame = frame.f_back  # type: ignore[assignment]
    outermost_frames = 1 if threading.get_ident() == caller_thread else 0
    return depth > outermost_frames
