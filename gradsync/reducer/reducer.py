"""The reducer: gradient hooks, the phase of the current step, the bucket layout, and the extension points.

Each parameter gets one post-accumulate-grad hook, which calls whatever the current phase says a ready gradient
means: nothing (a ``no_sync`` backward), the start of a synced backward, :meth:`BackwardStep.mark_ready` (see
:mod:`.step` for the path of one gradient), or an error (a second backward after the reduction). The phase changes
by rebinding that one function, and optional features (order recording for the rebuild, usage tracking, a
Monitor) are composed into it only when they are on, so the per-gradient path never tests a feature that is off.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from gradsync.collectives.communicator import Communicator, Op
from gradsync.comm.grad_bucket import GradBucket
from gradsync.errors import ConfigError, GradientError
from gradsync.observe.recorder import Recorder
from gradsync.reducer import messages
from gradsync.reducer.autotune import BucketTuning, tuning_enabled
from gradsync.reducer.buckets import Bucket, size_limits
from gradsync.reducer.layout import BucketLayout
from gradsync.reducer.mode import GraphMode
from gradsync.reducer.rebuild import Rebuild, State
from gradsync.reducer.step import BackwardStep, StepContext
from gradsync.reducer.unused import GlobalUsage

CommHook = Callable[[Any, GradBucket], torch.futures.Future]
ReadyFunction = Callable[[int], None]


class Reducer:
    """Averages the gradients of ``params`` across ``comm``'s process group during backward.

    Driven by :class:`gradsync.DistributedDataParallel`: at each forward whose backward synchronises,
    :meth:`before_synced_forward` then :meth:`prepare_for_backward`; at other forwards :meth:`skip_next_backward`.
    ``names[i]`` names ``params[i]`` in error messages.
    """

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        names: Sequence[str],
        comm: Communicator,
        bucket_cap_mb: float | str | Sequence[float] | None = None,
        gradient_as_bucket_view: bool = False,
        mode: GraphMode = GraphMode.ALL_USED,
    ) -> None:
        self.params = list(params)
        self.names = list(names)
        self.comm = comm
        self.mode = mode
        limits = size_limits(bucket_cap_mb)
        # Iteration 1: reverse registration order, torch's guess at the order gradients become ready.
        first_order = list(reversed(range(len(self.params))))
        self.layout = BucketLayout(self.params, first_order, limits, gradient_as_bucket_view)
        self._rebuild = Rebuild(
            self.params, comm, limits, gradient_as_bucket_view, mode.rebuilds, tuning_enabled(bucket_cap_mb)
        )
        self._usage = GlobalUsage(len(self.params), mode, comm)
        self._comm_hook: CommHook | None = None
        self._comm_state: Any = None
        self._recorder = Recorder()
        self._recorder_attached = False  # whether to poll it from every gradient hook
        self._bucket_reduced: Callable[[Bucket], None] | None = None
        self._context = self._make_context()
        self._step: BackwardStep | None = None
        self._unused: Sequence[int] = ()
        self.iteration = 0  # synced backward passes completed (a joined rank's shadows included)
        self._on_ready: ReadyFunction = _accumulate_locally
        self._handles = [p.register_post_accumulate_grad_hook(self._make_hook(i)) for i, p in enumerate(self.params)]

    # ------------------------------------------------------------------------------------- what it exposes
    @property
    def buckets(self) -> list[Bucket]:
        return self.layout.buckets

    @property
    def tuning(self) -> BucketTuning | None:
        """The bucket-size tuner's decision and evidence, once it has made one (``describe()`` says it in words)."""
        return self._rebuild.tuning

    @property
    def rebuilt(self) -> bool:
        """Whether the one-time rebuild has happened (the tuner's check may still be running)."""
        return self._rebuild.state not in (State.NEVER, State.RECORDING, State.PENDING)

    def describe_bucket(self, k: int) -> str:
        return messages.bucket_description(self.layout.buckets[k], len(self.layout), self.names)

    # ------------------------------------------------------------------------------------ extension points
    def set_comm_hook(self, state: Any, hook: CommHook) -> None:
        """Reduce each bucket with ``hook(state, GradBucket) -> Future[Tensor]`` (torch's contract)."""
        self._comm_state, self._comm_hook = state, hook
        self._context = self._make_context()

    def attach_recorder(self, recorder: Recorder) -> None:
        """Report this reducer's events (backward start and end, each bucket's ready, launch and completion)."""
        self._recorder, self._recorder_attached = recorder, True
        self._context = self._make_context()

    def detach_recorder(self) -> None:
        self._recorder, self._recorder_attached = Recorder(), False
        self._context = self._make_context()

    def on_bucket_reduced(self, callback: Callable[[Bucket], None]) -> None:
        """Call ``callback(bucket)`` as soon as each bucket's averages are in ``.grad``, while later buckets may
        still be in flight (gradsync.optim.OverlappedOptimizer steps that bucket's parameters there)."""
        if self.mode.tracks_usage:
            raise ConfigError(
                f"a per-bucket callback cannot be used with {self.mode.value}: which parameters were used on any "
                "rank is only known after the last bucket, too late to hand buckets on early."
            )
        self._bucket_reduced = callback
        self._context = self._make_context()

    def _make_context(self) -> StepContext:
        hooked = self._comm_hook is not None
        return StepContext(
            names=self.names,
            comm=self.comm,
            reduce=self._reduce_with_hook if hooked else self._reduce_builtin,
            divisor=None if hooked else self.comm.size,  # a hook averages itself, as torch's do
            usage=self._usage,
            recorder=self._recorder,
            bucket_reduced=self._bucket_reduced,
        )

    # ------------------------------------------------------------------------------------------- per step
    def before_synced_forward(self) -> None:
        """The rebuild's collectives, if due at this forward, and the layout it says to use from now on."""
        layout = self._rebuild.before_forward()
        if layout is None:
            return
        layout.adopt_current_grads()
        self.layout = layout
        if self._rebuild.done and self._may_silence_hooks():
            for i in layout.silence_small_hooks(self._rebuild.local_order):
                self._handles[i].remove()

    def _may_silence_hooks(self) -> bool:
        # Only a static graph runs the same hooks in the same order every time, and only this rank's own observed
        # order says which is last. GRADSYNC_DEBUG keeps every hook, so a rank whose graph changed is still caught.
        return (
            self.mode is GraphMode.STATIC
            and bool(self._rebuild.local_order)
            and not self._unused
            and not self.comm.check_desync
        )

    def prepare_for_backward(self, unused: Sequence[int] = (), scale: float = 1.0) -> None:
        """Arm the next backward to reduce. ``unused`` parameters count as ready with their current gradient;
        ``scale`` multiplies the averages (join with divide_by_initial_world_size=False)."""
        self._step = BackwardStep(self._context, self.layout, scale)
        self._unused = unused
        self._on_ready = self._begin_backward

    def skip_next_backward(self) -> None:
        """Let the next backward accumulate gradients locally (no_sync / require_backward_grad_sync=False)."""
        self._step = None
        self._on_ready = _accumulate_locally

    def shadow_backward(self) -> None:
        """A joined rank: issue this backward's collectives with zeros, exactly as a training rank would."""
        start = time.perf_counter()
        step = BackwardStep(self._context, self.layout, shadow=True)
        step.launch_all_as_shadow()
        step.finish()
        self._end_synced_backward(time.perf_counter() - start)

    # ------------------------------------------------------------------------------------ the hooks' side
    def _make_hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(_param: torch.Tensor) -> None:
            self._on_ready(index)

        return hook

    def _begin_backward(self, index: int) -> None:
        """The first gradient of a synced backward: arm the end-of-backward callback, then handle it."""
        step = self._step
        assert step is not None
        step.started = time.perf_counter()
        self._rebuild.backward_started(step.started)
        torch.autograd.Variable._execution_engine.queue_callback(self._finalize)
        self._recorder.backward_start(self.layout.buckets)
        self._on_ready = on_ready = self._ready_function(step)
        mark_unused = self._recording(step.mark_ready)  # ready with their current gradient, but never "used"
        for j in self._unused:
            mark_unused(j)
        on_ready(index)

    def _ready_function(self, step: BackwardStep) -> ReadyFunction:
        on_ready: ReadyFunction = step.mark_ready
        if step.used is not None:
            on_ready = _also_mark_used(step.used, on_ready)
        on_ready = self._recording(on_ready)
        if self._recorder_attached:
            on_ready = _also_poll(self._recorder, on_ready)
        return on_ready

    def _recording(self, on_ready: ReadyFunction) -> ReadyFunction:
        return _also_record(self._rebuild.record, on_ready) if self._rebuild.recording else on_ready

    def _finalize(self) -> None:
        step = self._step
        assert step is not None
        self._on_ready = self._reached_after_reduction
        self._recorder.backward_end()
        step.finish()
        self._recorder.comm_end()
        self._step = None
        self._end_synced_backward(time.perf_counter() - step.started)

    def _end_synced_backward(self, seconds: float) -> None:
        self.iteration += 1
        self._rebuild.backward_done(seconds)

    def _reached_after_reduction(self, index: int) -> None:
        raise GradientError(messages.backward_after_reduction(self.names[index]))

    # ---------------------------------------------------------------------------------- starting a bucket
    def _reduce_builtin(self, k: int, buffer: torch.Tensor, views: list[torch.Tensor], is_last: bool):
        # Gradients were divided by the world size on their way in: one plain sum, torch's C++ default path.
        return self.comm.all_reduce_async(Op.BUCKET_ALLREDUCE, buffer, index=k)

    def _reduce_with_hook(self, k: int, buffer: torch.Tensor, views: list[torch.Tensor], is_last: bool):
        hook = self._comm_hook
        assert hook is not None
        # A fresh GradBucket each launch: hooks may set_buffer() on it, as in torch.
        bucket = GradBucket(k, buffer, views, self.layout.buckets[k].params, is_last)
        future = self.comm.launch(Op.BUCKET_ALLREDUCE, k, buffer, lambda: hook(self._comm_state, bucket))
        if not isinstance(future, torch._C.Future):  # torch.futures.Future and what .then() returns
            raise ConfigError(
                f"communication hook {getattr(hook, '__name__', hook)!r} returned {type(future).__name__} for "
                f"bucket {k}; it must return a torch.futures.Future[torch.Tensor]."
            )
        return future


def _accumulate_locally(_index: int) -> None:
    """No synced forward was prepared (no_sync): autograd's accumulation in ``.grad`` is all there is to do."""


def _also_mark_used(used: bytearray, inner: ReadyFunction) -> ReadyFunction:
    def mark(i: int) -> None:
        used[i] = 1
        inner(i)

    return mark


def _also_record(record: Callable[[int], None], inner: ReadyFunction) -> ReadyFunction:
    def mark(i: int) -> None:
        record(i)
        inner(i)

    return mark


def _also_poll(recorder: Recorder, inner: ReadyFunction) -> ReadyFunction:
    def mark(i: int) -> None:
        recorder.poll()
        inner(i)

    return mark
