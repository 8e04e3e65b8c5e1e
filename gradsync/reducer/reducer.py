"""The reducer: gradient hooks, the phase of the current step, the bucket layout, and the extension points.

Each parameter gets one post-accumulate-grad hook, which calls whatever the current phase says a ready gradient
means: nothing (a ``no_sync`` backward, or after the reduction, as in torch), the start of a synced backward, or
:meth:`BackwardStep.mark_ready` (see :mod:`.step` for the path of one gradient). The phase changes by rebinding that
one function; optional features are composed into it only when they are on (:mod:`.ready`).

When backward ends: the last bucket's launch queues the finalizer on the autograd engine (as torch's reducer does),
so it runs after the last gradient even under reentrant checkpointing, where hooks fire inside a nested backward.
A check queued at the start of the outermost backward (by :mod:`.sink`, or the first hook) names the parameters
that never got a gradient. With ``static_graph`` the first iteration launches nothing during backward: it learns
which parameters are used, then reduces everything at the end (torch's delayed all-reduce).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from gradsync.collectives.communicator import Communicator, Op
from gradsync.comm.grad_bucket import GradBucket
from gradsync.errors import ConfigError, GradientError
from gradsync.observe.clock import clock_for
from gradsync.observe.recorder import Recorder
from gradsync.reducer import messages, ready
from gradsync.reducer.autotune import BucketTuning
from gradsync.reducer.buckets import AnyBucket
from gradsync.reducer.caps import BucketCaps
from gradsync.reducer.layout import BucketLayout, Storage
from gradsync.reducer.mode import GraphMode
from gradsync.reducer.rebuild import Rebuild, State
from gradsync.reducer.step import BackwardStep, StepContext
from gradsync.reducer.unused import GlobalUsage, unused_parameter_indices

CommHook = Callable[[Any, GradBucket], torch.futures.Future]


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
        caps: BucketCaps,
        gradient_as_bucket_view: bool = False,
        mode: GraphMode = GraphMode.ALL_USED,
        sparse: Sequence[bool] | None = None,
        skip_unused: bool = False,
    ) -> None:
        self.params = list(params)
        self.names = list(names)
        self.comm = comm
        self.mode = mode
        # Iteration 1: reverse registration order, torch's guess at the order gradients become ready.
        first_order = list(reversed(range(len(self.params))))
        self.layout = BucketLayout(self.params, first_order, list(caps.limits), gradient_as_bucket_view, sparse)
        device = self.params[0].device if self.params else torch.device("cpu")
        self._rebuild = Rebuild(self.params, comm, self.layout, mode.rebuilds, caps.tune, clock_for(device))
        self._usage = GlobalUsage(len(self.params), mode, comm, assume_same_everywhere=skip_unused)
        self._comm_hook: CommHook | None = None
        self._comm_state: Any = None
        self._hook_agreed = False  # every rank reduces with the same hook: checked at the first synced backward
        self._recorder = Recorder()
        self._recorder_attached = False  # whether to poll it from every gradient hook
        self._bucket_reduced: Callable[[AnyBucket], None] | None = None
        self._context = self._make_context()
        self._step: BackwardStep | None = None
        self._unused: Sequence[int] = ()
        self._static_unused: list[int] | None = None  # static_graph: learned in the first backward
        self._forward_thread = threading.get_ident()
        self.iteration = 0  # synced backward passes completed (a joined rank's shadows included)
        self._on_ready: ready.ReadyFunction = self._idle_function()
        self._handles = [p.register_post_accumulate_grad_hook(self._make_hook(i)) for i, p in enumerate(self.params)]

    # ------------------------------------------------------------------------------------- what it exposes
    @property
    def buckets(self) -> list[AnyBucket]:
        return self.layout.buckets

    @property
    def tuning(self) -> BucketTuning | None:
        """The bucket-size tuner's decision and evidence, once it has made one (``describe()`` says it in words)."""
        return self._rebuild.tuning

    @property
    def rebuilt(self) -> bool:
        """Whether the one-time rebuild has happened (the tuner's check may still be running)."""
        return self._rebuild.state not in (State.NEVER, State.RECORDING, State.PENDING)

    @property
    def needs_output_sink(self) -> bool:
        """Whether this forward's outputs must pass through :mod:`.sink` (as torch's ``_DDPSink``): a dynamic graph
        (outputs the loss does not use must send undefined gradients) and static_graph's first iteration."""
        return self.mode is GraphMode.FIND_UNUSED or (self.mode is GraphMode.STATIC and self._static_unused is None)

    def close(self) -> None:
        """Remove every gradient hook: this reducer stops averaging (its model is being given a new one)."""
        for handle in self._handles:
            handle.remove()
        self._on_ready = ready.accumulate_locally

    def steady_bucket_cap(self) -> int:
        """The byte cap of every bucket after the first, in the current layout."""
        return self.layout.limits[-1]

    def compiled_in_pieces(self) -> None:
        """torch.compile split the model's graph at this reducer's cap (:mod:`gradsync.ddp.compiled`): each
        piece's backward is one autograd node. The split is fixed when dynamo compiles, so the caps are too: a
        tuner's proposal would need a split, and a recompile, of its own (its trial would recompile at every step).
        The one-time rebuild still happens: it reorders the buckets into the pieces' order, which needs none."""
        self._rebuild.disable_tuning()

    def describe_bucket(self, k: int) -> str:
        return messages.bucket_description(self.layout.buckets[k], len(self.layout), self.names)

    # ------------------------------------------------------------------------------------ extension points
    def set_comm_hook(self, state: Any, hook: CommHook) -> None:
        """Reduce each bucket with ``hook(state, GradBucket) -> Future[Tensor]`` (torch's contract)."""
        self._comm_state, self._comm_hook = state, hook
        self._context = self._make_context()
        if state is not None and not isinstance(state, dist.ProcessGroup):
            # A hook with a state object may keep memory per bucket index (PowerSGD's error and P/Q matrices, the
            # quantized hook's error feedback), which torch sizes for one layout after its single rebuild. The
            # tuner's trial alternates two layouts, so such hooks get torch's caps and no trial.
            self._rebuild.disable_tuning()

    def attach_recorder(self, recorder: Recorder) -> None:
        """Report this reducer's events (backward start and end, each bucket's ready, launch and completion)."""
        self._recorder, self._recorder_attached = recorder, True
        self._context = self._make_context()

    def detach_recorder(self) -> None:
        self._recorder, self._recorder_attached = Recorder(), False
        self._context = self._make_context()

    def on_bucket_reduced(self, callback: Callable[[AnyBucket], None]) -> None:
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
            twice=self._ready_twice_error,
            reduce=self._reduce_with_hook if hooked else self._reduce_builtin,
            divisor=None if hooked else self.comm.size,  # a hook averages itself, as torch's do
            usage=self._usage,
            recorder=self._recorder,
            bucket_reduced=self._bucket_reduced,
        )

    # ------------------------------------------------------------------------------------------- per step
    def before_synced_forward(self) -> None:
        """The rebuild's collectives, if due at this forward, and the layout it says to use from now on."""
        layout = self._rebuild.before_forward(release=self._release_layout)
        if layout is None:
            return
        layout.adopt_current_grads()
        self.layout = layout
        if self._rebuild.done and self._may_silence_hooks():
            for i in layout.silence_small_hooks(self._rebuild.local_order):
                self._handles[i].remove()

    def _release_layout(self) -> Storage | None:
        """Before the rebuild (or the tuner's trial) builds a layout: let go of the current one and hand its storage
        over, so the gradients' buckets exist once, not once per layout (torch's rebuild frees its buckets first
        too). With gradient_as_bucket_view the .grad tensors are its slots, which the new layout copies from, so
        it keeps them until then and gets a storage of its own."""
        step = self._step
        if self.layout.as_view or (step is not None and step.started and not step.finished):
            return None  # an unfinished step is reported at prepare_for_backward, and needs its layout for that
        storage = self.layout.storage
        self._step = None  # the last step's BackwardStep holds the layout too
        self.layout = BucketLayout([], [], self.layout.limits, False, None)  # empty until the rebuild's arrives
        return storage

    def _may_silence_hooks(self) -> bool:
        # Only a static graph runs the same hooks in the same order every time, and only this rank's own observed
        # order says which is last. GRADSYNC_DEBUG keeps every hook, so a rank whose graph changed is still caught.
        return (
            self.mode is GraphMode.STATIC
            and bool(self._rebuild.local_order)
            and not self._static_unused
            and not self.comm.check_desync
        )

    def prepare_for_backward(self, outputs: Iterable[torch.Tensor] = (), scale: float = 1.0) -> None:
        """Arm the next backward to reduce. ``outputs``: the forward's tensors (find_unused_parameters walks their
        graph); ``scale`` multiplies the averages (join with divide_by_initial_world_size=False)."""
        self._raise_if_unfinished()
        self._step = BackwardStep(self._context, self.layout, scale, on_all_launched=self._queue_finalize)
        self._unused = self._unused_parameters(outputs)
        self._forward_thread = threading.get_ident()
        self._on_ready = self._begin_backward

    def _unused_parameters(self, outputs: Iterable[torch.Tensor]) -> Sequence[int]:
        if self.mode is GraphMode.FIND_UNUSED:
            with torch.autograd.profiler.record_function("search_unused_parameters"):  # torch's profiler label
                return unused_parameter_indices(outputs, self.params)
        return self._static_unused or ()

    def skip_next_backward(self) -> None:
        """Let the next backward accumulate gradients locally (no_sync / require_backward_grad_sync=False)."""
        self._raise_if_unfinished()
        self._step = None
        self._on_ready = self._idle_function()

    def shadow_backward(self) -> None:
        """A joined rank: issue this backward's collectives with zeros, exactly as a training rank would."""
        self._rebuild.backward_started()
        self._agree_on_hook_once()
        step = BackwardStep(self._context, self.layout, shadow=True)
        step.launch_all_as_shadow()
        step.finish()
        self._end_synced_backward()

    def sink_backward_started(self) -> None:
        """The outputs' sink ran: this is the outermost backward of the armed step; check its end there."""
        step = self._step
        if step is not None and not step.end_queued and not step.finished:
            step.end_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    # ------------------------------------------------------------------------------------ the hooks' side
    def _make_hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(_param: torch.Tensor) -> None:
            self._on_ready(index)

        return hook

    def _idle_function(self) -> ready.ReadyFunction:
        # Outside a synced backward, usage is still tracked where it is all-reduced at the next synced step: a
        # parameter used only in no_sync micro-batches has gradients to average too (torch's local_used_map).
        used = self._usage.local_map()
        if used is None:
            return ready.accumulate_locally
        return ready.marking_used(used, self.params, ready.accumulate_locally)

    def _after_reduction_function(self) -> ready.ReadyFunction:
        # torch: gradients after the reduction (a second backward of one forward, or another wrapper of the same
        # module training) accumulate locally. Under GRADSYNC_DEBUG a rank doing so is warned, once.
        idle = self._idle_function()
        if not self.comm.check_desync:
            return idle
        return ready.warning_once(messages.backward_after_reduction(self.names), idle)

    def _begin_backward(self, index: int) -> None:
        """The first gradient of a synced backward: arm the end-of-backward check, then handle it."""
        step = self._step
        assert step is not None
        if torch.compiler.is_compiling():
            raise ConfigError(messages.compiled_autograd())
        self._agree_on_hook_once()
        step.started = time.perf_counter()
        self._rebuild.backward_started()
        if not step.end_queued:
            step.end_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        self._recorder.backward_start(self.layout.buckets)
        if self._delays_reduction():
            self._on_ready = on_ready = self._learning_function(step)
        else:
            self._on_ready = on_ready = self._ready_function(step)
            mark_unused = self._recording(step.mark_ready)  # ready with their current gradient, never "used"
            for j in self._unused:
                mark_unused(j)
        on_ready(index)

    def _delays_reduction(self) -> bool:
        return self.mode is GraphMode.STATIC and self._static_unused is None

    def _ready_function(self, step: BackwardStep) -> ready.ReadyFunction:
        on_ready: ready.ReadyFunction = step.mark_ready
        if step.used is not None:
            on_ready = ready.marking_used(step.used, self.params, on_ready)
        on_ready = self._recording(on_ready)
        if self._recorder_attached:
            on_ready = ready.polling(self._recorder.poll, on_ready)
        if torch.is_grad_enabled():  # backward(create_graph=True)
            on_ready = ready.without_grad(on_ready)
        return on_ready

    def _learning_function(self, step: BackwardStep) -> ready.ReadyFunction:
        """static_graph's first backward: note who is used and in which order; reduce at the end."""
        fired = step.fired = []
        on_ready: ready.ReadyFunction = fired.append
        if step.used is not None:
            on_ready = ready.marking_used(step.used, self.params, on_ready)
        return self._recording(on_ready)

    def _recording(self, on_ready: ready.ReadyFunction) -> ready.ReadyFunction:
        return ready.recording(self._rebuild.record, on_ready) if self._rebuild.recording else on_ready

    # ------------------------------------------------------------------------------------ end of backward
    def _end_of_backward(self) -> None:
        """Queued at the start of the backward: by now every gradient should have arrived."""
        step = self._step
        if step is None or step.finished or step.all_launched:
            return  # the finalizer (queued by the last launch) does the rest
        if step.fired is not None:
            self._reduce_what_was_learned(step)
        elif ready.inside_nested_backward(self._forward_thread):
            task = ready.current_graph_task()
            queue = lambda: torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)  # noqa: E731
            self._on_ready = ready.requeue_on_new_graph_task(task, queue, self._on_ready)
        else:
            step.raise_not_ready(
                messages.unused_hint(self.mode is GraphMode.FIND_UNUSED, self.mode is GraphMode.STATIC)
            )

    def _reduce_what_was_learned(self, step: BackwardStep) -> None:
        """static_graph's first backward ended: what fired is used, the rest is unused from now on (this rank's
        graph; the usage all-reduce tells which no rank used)."""
        self._agree_on_hook_once()
        fired = step.fired or []
        seen = set(fired)
        self._static_unused = [i for i in range(len(self.params)) if i not in seen]
        step.fired = None
        with torch.no_grad():
            for i in fired + self._static_unused:
                step.mark_ready(i)  # the last launch queues the finalizer, right behind this callback

    def _queue_finalize(self) -> None:
        torch.autograd.Variable._execution_engine.queue_callback(self._finalize)

    def _finalize(self) -> None:
        step = self._step
        if step is None or step.finished:
            return
        self._on_ready = self._after_reduction_function()
        self._recorder.backward_end()
        with torch.no_grad():
            step.finish()
        self._recorder.comm_end()
        self._end_synced_backward()

    def _end_synced_backward(self) -> None:
        self.iteration += 1
        self._rebuild.backward_done()

    def _raise_if_unfinished(self) -> None:
        step = self._step
        if step is not None and step.started and not step.finished:
            message = messages.unfinished_reduction(torch.distributed.get_rank(), step.missing())
            self._step = None
            raise GradientError(message)

    def _agree_on_hook_once(self) -> None:
        """Before this reducer's first bucket collective, on every rank: the same comm hook (or none) everywhere.

        A hook registered on some ranks only (``if rank == 0: register_comm_hook(...)``) sends bf16 or compressed
        buckets against the others' float32 all-reduce, and gloo aborts the process on the size mismatch. One
        small all-gather, once, names it instead; it is not an all-reduce, so profiles count torch's all-reduces.
        """
        if self._hook_agreed:
            return
        mine = messages.hook_identity(self._comm_hook, self._comm_state)
        everyone = self.comm.all_gather_object(Op.HOOK_CHECK, mine)
        self._hook_agreed = True
        if len(set(everyone)) > 1:
            raise ConfigError(messages.hook_mismatch(everyone, self.comm.global_rank))

    def _ready_twice_error(self, index: int) -> Exception:
        if self.mode is GraphMode.STATIC and self._static_unused and index in self._static_unused:
            return GradientError(messages.graph_changed(self.names[index]))
        return GradientError(messages.ready_twice(self.names[index]))

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
