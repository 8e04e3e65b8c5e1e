"""The reducer: gradient hooks, the phase of the current step, the bucket layout, and the extension points.

The reducer owns the two halves of the gradient path: :mod:`.backward` (one backward: the hooks, the step, how a
bucket is reduced) and :mod:`.buckets` (where gradients live). Each parameter's hook
(:class:`~.backward.GradientHooks`) calls :meth:`Reducer._gradient_ready`, the one place that decides what a ready
gradient means, by the current step's :class:`~.backward.BackwardPhase`:

==================================  =========================================================================
no step (``no_sync``), or FINISHED  autograd's local accumulation (usage still marked where it is tracked)
ARMED                               :meth:`Reducer._begin_backward`: the first gradient of a synced backward
LEARNING                            static_graph's first backward notes the parameter (:mod:`.static_graph`)
REDUCING                            :meth:`~.backward.BackwardStep.mark_ready`: into its bucket
==================================  =========================================================================

When backward ends: the last bucket's launch queues the finalizer on the autograd engine (as torch's reducer does),
so it runs after the last gradient even under reentrant checkpointing, where hooks fire inside a nested backward.
A check queued at the start of the outermost backward (by :mod:`.sink`, or the first hook) names the parameters
that never got a gradient. With ``static_graph`` the first iteration launches nothing during backward: it learns
which parameters are used, then reduces everything at the end (torch's delayed all-reduce).
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from gradsync import settings, torch_private
from gradsync.collectives.communicator import Communicator, Op
from gradsync.errors import ConfigError, GradientError
from gradsync.observe.clock import clock_for
from gradsync.observe.recorder import Recorder
from gradsync.reducer import backward, messages
from gradsync.reducer.autotune import BucketTuning
from gradsync.reducer.backward import (
    BackwardPhase,
    BackwardStep,
    BucketReduction,
    CommHook,
    GradientHooks,
    HookReduction,
    ReducePrecision,
    StepContext,
    built_in_reduction,
    checked_if,
)
from gradsync.reducer.buckets import AnyBucket, BucketLayout, Lending, LendingChoice, Storage
from gradsync.reducer.caps import BucketCaps
from gradsync.reducer.local_params import LocalParams
from gradsync.reducer.mode import GraphMode
from gradsync.reducer.rebuild import Rebuild, RebuildState
from gradsync.reducer.sink import pass_through_sink
from gradsync.reducer.static_graph import StaticGraph
from gradsync.reducer.unused import GlobalUsage, unused_parameter_indices


class Reducer:
    """Averages the gradients of ``params`` across ``comm``'s process group during backward.

    Driven by :class:`gradsync.DistributedDataParallel`: at each forward whose backward synchronises,
    :meth:`before_synced_forward` then :meth:`prepare_for_backward`; at other forwards :meth:`skip_next_backward`.
    ``names[i]`` names ``params[i]`` in error messages. A DTensor parameter (tensor parallelism) is reduced through
    its local shard (:mod:`.local_params`): ``self.params`` holds the plain tensors the buckets read and write.
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
        precision: ReducePrecision | None = None,
        check_finite: bool = False,
    ) -> None:
        self._local = LocalParams(params)
        self.params = self._local.locals
        self.names = list(names)
        self.comm = comm
        self.mode = mode
        self._caps = caps
        first_limits = caps.first_limits(mode.rebuilds)
        grad_dtype = precision.dtype if precision is not None else None  # mixed precision: the buckets' dtype
        self.layout = BucketLayout.first(self.params, first_limits, gradient_as_bucket_view, sparse, grad_dtype)
        device = self.params[0].device if self.params else torch.device("cpu")
        static = mode is GraphMode.STATIC
        self._rebuild = Rebuild(self.params, comm, self.layout, caps, mode.rebuilds, clock_for(device), static)
        self._usage = GlobalUsage(len(self.params), mode, comm, assume_same_everywhere=skip_unused)
        self._static = StaticGraph(len(self.params)) if static else None
        # check_for_nan_in_grad: the parameters' names by tensor id, for the check every reduction is wrapped in.
        self._finite_check = {id(p): n for p, n in zip(self.params, self.names)} if check_finite else None
        self._reduction: BucketReduction = checked_if(self._finite_check, built_in_reduction(comm, precision))
        self._hook_agreed = False  # every rank reduces with the same hook: checked at the first synced backward
        self._recorder = Recorder()
        self._recorder_attached = False  # whether to poll it from every gradient hook
        self._bucket_reduced: Callable[[AnyBucket], None] | None = None
        self._hooks = GradientHooks(self._local.params, self._loud_hook)
        self._context = self._make_context()
        self._step: BackwardStep | None = None
        self._nested_task: int | None = None  # a nested backward ended early: the graph task it ended in
        self._warned_after_reduction = False
        self._unused: Sequence[int] = ()
        self._forward_thread = threading.get_ident()
        self.iteration = 0  # synced backward passes completed (a joined rank's shadows included)
        self._lending = Lending(settings.lending())

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
        state = self._rebuild.state
        return state not in (RebuildState.NEVER, RebuildState.WAITING, RebuildState.RECORDING, RebuildState.PENDING)

    def quiet_parameters(self) -> int:
        """How many parameters' hooks are quiet now (:class:`.backward.GradientHooks`)."""
        return self._hooks.quiet_count()

    def _needs_output_sink(self) -> bool:
        """Whether this forward's outputs must pass through :mod:`.sink` (as torch's ``_DDPSink``): a dynamic graph
        (outputs the loss does not use must send undefined gradients) and static_graph's first iteration."""
        return self.mode is GraphMode.FIND_UNUSED or (self._static is not None and self._static.learning)

    def close(self) -> None:
        """Remove every gradient hook: this reducer stops averaging (its model is being given a new one)."""
        self._hooks.close()

    def steady_bucket_cap(self) -> int:
        """The byte cap of every bucket after the first: the current layout's once rebuilt, else the configured one
        (iteration 1 may be one bucket, see :meth:`BucketCaps.first_limits`)."""
        return self.layout.limits[-1] if self.rebuilt else self._caps.limits[-1]

    def compiled_in_pieces(self) -> None:
        """torch.compile split the model's graph at this reducer's cap (:mod:`gradsync.ddp.compiled`): each
        piece's backward is one autograd node. The split is fixed when dynamo compiles, so the caps are too: a
        tuner's proposal would need a split, and a recompile, of its own (its trial would recompile at every step).
        The one-time rebuild still happens: it reorders the buckets into the pieces' order, which needs none."""
        self._rebuild.disable_tuning()

    # ------------------------------------------------------------------------------------ extension points
    def set_comm_hook(self, state: Any, hook: CommHook) -> None:
        """Reduce each bucket with ``hook(state, GradBucket) -> Future[Tensor]`` (torch's contract)."""
        self._reduction = checked_if(self._finite_check, HookReduction(self.comm, state, hook))
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
        if self._local.sharded:
            raise ConfigError(messages.per_bucket_with_dtensors(self.names, self._local.sharded))
        self._bucket_reduced = callback
        self._context = self._make_context()

    def _make_context(self) -> StepContext:
        return StepContext(
            names=self.names,
            comm=self.comm,
            reduction=self._reduction,
            static=self._static,
            usage=self._usage,
            recorder=self._recorder,
            bucket_reduced=self._bucket_reduced,
            hooks=self._hooks,
        )

    # ------------------------------------------------------------------------------------------- per step
    def before_synced_forward(self) -> None:
        """The rebuild's collectives, if due at this forward, and the layout it says to use from now on."""
        layout = self._rebuild.before_forward(release=self._release_layout)
        if layout is None:
            return
        layout.adopt_current_grads()
        self._adopt(layout)

    def _adopt(self, layout: BucketLayout) -> None:
        """Reduce into ``layout`` from now on, with quiet hooks where they may be."""
        self.layout = layout
        if self._may_quiet_hooks():
            self._hooks.quiet_down(layout, self._rebuild.local_order)
        else:
            self._hooks.all_loud()

    def _may_quiet_hooks(self) -> bool:
        """Whether each bucket's last-ready hook may stand for the others (:class:`.backward.GradientHooks`): once
        the rebuild has settled the buckets and this rank's ready order is known, every parameter used in every
        iteration, and the order never seen to change. A DTensor parameter's hook also brings its gradient in
        (local_params.py), and GRADSYNC_DEBUG's desync check keeps every hook, so a rank whose graph changed is
        still caught the moment it happens."""
        if self._hooks.order_changed or not self._rebuild.done or self._local.sharded or self.comm.check_desync:
            return False
        order = self._rebuild.local_order
        if self.mode is GraphMode.STATIC:
            assert self._static is not None
            return self._static.may_silence_hooks(order, self.comm.check_desync)
        return self.mode is GraphMode.ALL_USED and len(order) == len(self.params)

    def bucket_plan(self) -> tuple[list[int], list[int]] | None:
        """The buckets' order and caps once rebuilt (None before, and under static_graph, whose first iterations
        learn more than the order), for a new group's reducer to :meth:`start_from`."""
        return None if self._static is not None else self._rebuild.decided()

    def start_from(self, plan: tuple[list[int], list[int]] | None) -> None:
        """Rank 0's :meth:`bucket_plan`, taken by every member of a new elastic round before its first synced
        forward: the round starts with the rebuilt buckets, not an iteration of one bucket. That keeps a comm
        hook's per-bucket memory (PowerSGD's, past its start iteration) sized for buckets that do not change."""
        if plan is None:
            return
        if self.iteration or not self._rebuild.recording:
            raise ConfigError(
                f"start_from: this reducer already ran {self.iteration} synced backward(s) "
                f"({self._rebuild.state.value}); a bucket plan is taken before the first synced forward of a new group"
            )
        self._adopt(self._rebuild.adopt(plan, self._release_layout))

    def _release_layout(self) -> Storage | None:
        """Before the rebuild (or the tuner's trial) builds a layout: let go of the current one and hand its storage
        over, so the gradients' buckets exist once, not once per layout (torch's rebuild frees its buckets first
        too). With gradient_as_bucket_view the .grad tensors are its slots, which the new layout copies from, so
        it keeps them until then and gets a storage of its own."""
        step = self._step
        if self.layout.as_view or (step is not None and step.unfinished):
            return None  # an unfinished step is reported at prepare_for_backward, and needs its layout for that
        storage = self.layout.storage
        self._step = None  # the last step's BackwardStep holds the layout too
        self.layout = BucketLayout([], [], self.layout.limits, False, None)  # empty until the rebuild's arrives
        return storage

    def prepare_for_backward(
        self, outputs: list[torch.Tensor], scale: float = 1.0
    ) -> Callable[[list[torch.Tensor]], list[torch.Tensor]] | None:
        """Arm the next backward to reduce. ``outputs``: the forward's tensors (find_unused_parameters walks their
        graph); ``scale`` multiplies the averages (join with divide_by_initial_world_size=False). Returns what the
        forward's output tensors must pass through for this step, the outputs' sink (:mod:`.sink`), or None."""
        self._raise_if_unfinished()
        self._hooks.speak_up_if_order_changed()
        self._hooks.clear_heard()
        self._unused = self._unused_parameters(outputs)
        if self._local.sharded:
            self._local.bring_in_all()
        self._forward_thread = threading.get_ident()
        lend = self._lend_or_move()
        self._set_step(BackwardStep(self._context, self.layout, scale, on_all_launched=self._queue_finalize, lend=lend))
        return self._through_sink if self._needs_output_sink() else None

    def _lend_or_move(self) -> bool:
        """Whether this step may lend large averaged slots to ``.grad`` instead of copying them
        (:class:`.buckets.Lending`): the final layout's only (the rebuild and the tuner's trial hand storages between
        layouts), never with gradient_as_bucket_view. A slot lent at the last step and still held moves the buckets
        off that storage. A loop that keeps its gradients (``zero_grad(set_to_none=False)``) lends nothing: its
        ``.grad`` would only trade its memory for a slot, and the buckets would move to a new storage at the next
        step, one more allocation of their size for no copy saved."""
        if not self._rebuild.done or self.layout.as_view or self.layout.casts:
            return False  # a low-precision slot cannot be lent to a full-precision .grad (mixed precision)
        choice = self._lending.before_step(list(self.layout.storage.values()))
        if choice is LendingChoice.MOVE:
            self._adopt(self.layout.moved())
        return choice is LendingChoice.LEND and all(p.grad is None for p in self.layout.large_params)

    def _through_sink(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return pass_through_sink(tensors, self._sink_reached)

    def _unused_parameters(self, outputs: Iterable[torch.Tensor]) -> Sequence[int]:
        if self.mode is GraphMode.FIND_UNUSED:
            with torch.autograd.profiler.record_function("search_unused_parameters"):  # torch's profiler label
                return unused_parameter_indices(outputs, self._local.params)
        return (self._static.unused or ()) if self._static is not None else ()

    def skip_next_backward(self) -> None:
        """Let the next backward accumulate gradients locally (no_sync / require_backward_grad_sync=False)."""
        self._raise_if_unfinished()
        self._hooks.clear_heard()  # the quiet hooks note every backward; only a synced one reads the notes
        self._set_step(None)

    def shadow_backward(self) -> None:
        """A joined rank: issue this backward's collectives with zeros, exactly as a training rank would."""
        self._rebuild.backward_started()
        self._agree_on_hook_once()
        step = BackwardStep(self._context, self.layout, shadow=True)
        step.launch_all_as_shadow()
        step.finish()
        self._end_synced_backward()

    def _sink_reached(self) -> None:
        """The outputs' sink ran: this is the outermost backward of the armed step; check its end there."""
        step = self._step
        if step is not None and step.claim_end_check():
            torch_private.queue_backward_callback(self._end_of_backward)

    # ------------------------------------------------------------------------------------ the hooks' side
    def _loud_hook(self, index: int) -> Callable[[Any, Any], None]:
        """Parameter ``index``'s own hook (:class:`.backward.GradientHooks` registers it)."""
        if self._local.is_sharded(index):
            bring_in = self._local.bring_in

            def sharded_hook(_grad_inputs: Any, _grad_outputs: Any) -> None:
                bring_in(index)  # the DTensor's gradient, as its local shard (local_params.py)
                self._gradient_ready(index)

            return sharded_hook

        def hook(_grad_inputs: Any, _grad_outputs: Any) -> None:
            self._gradient_ready(index)

        return hook

    def _gradient_ready(self, i: int) -> None:
        """What parameter ``i``'s gradient being ready means now: the module docstring's table, in one place."""
        step = self._step
        if step is None or step.finished:
            self._outside_synced_backward(i, step)
            return
        if self._nested_task is not None and backward.current_graph_task() != self._nested_task:
            # A nested backward ended with gradients still to come, and the outer one goes on: check its end.
            self._nested_task = None
            torch_private.queue_backward_callback(self._end_of_backward)
        if step.phase is BackwardPhase.ARMED:
            self._begin_backward(step)
        if self._rebuild.recording:
            self._rebuild.record(i)
        if step.used is not None and self.params[i].grad is not None:
            step.used[i] = 1  # torch's rule: an undefined gradient (an output the loss does not use) is not a use
        if step.phase is BackwardPhase.LEARNING:
            assert self._static is not None
            self._static.fired(i)  # static_graph's first backward: noted, reduced at its end
            return
        if self._recorder_attached:
            self._recorder.poll()
        if torch.is_grad_enabled():  # backward(create_graph=True): copying into buckets must not be recorded
            with torch.no_grad():
                step.mark_ready(i)
        else:
            step.mark_ready(i)

    def _outside_synced_backward(self, i: int, step: BackwardStep | None) -> None:
        """No synced forward was prepared (no_sync), or the reduction is over: autograd's accumulation is all.
        Usage is still tracked where it is all-reduced at the next synced step: a parameter used only in no_sync
        micro-batches has gradients to average too (torch's local_used_map)."""
        used = self._usage.local_map()
        if used is not None and self.params[i].grad is not None:
            used[i] = 1
        if step is not None and self.comm.check_desync and not self._warned_after_reduction:
            # torch: gradients after the reduction (a second backward of one forward, or another wrapper of the
            # same module training) accumulate locally. Under GRADSYNC_DEBUG a rank doing so is warned, once.
            self._warned_after_reduction = True
            warnings.warn(messages.backward_after_reduction(self.names)(i), RuntimeWarning, stacklevel=2)

    def _set_step(self, step: BackwardStep | None) -> None:
        self._step = step
        self._nested_task = None
        self._warned_after_reduction = False

    def _begin_backward(self, step: BackwardStep) -> None:
        """The first gradient of a synced backward: arm the end-of-backward check, then reduce or learn."""
        if torch.compiler.is_compiling():
            raise ConfigError(messages.compiled_autograd())
        self._agree_on_hook_once()
        self._rebuild.backward_started()
        if step.claim_end_check():
            torch_private.queue_backward_callback(self._end_of_backward)
        self._recorder.backward_start(self.layout.buckets)
        learning = self._static is not None and self._static.learning
        step.begin(learning=learning)
        if learning:
            assert self._static is not None
            self._static.start_learning()
            return
        for j in self._unused:  # ready with their current gradient, never "used"
            if self._rebuild.recording:
                self._rebuild.record(j)
            step.mark_ready(j)

    # ------------------------------------------------------------------------------------ end of backward
    def _end_of_backward(self) -> None:
        """Queued at the start of the backward: by now every gradient should have arrived."""
        step = self._step
        if step is None or step.finished or step.all_launched:
            return  # the finalizer (queued by the last launch) does the rest
        if step.phase is BackwardPhase.LEARNING:
            self._reduce_what_was_learned(step)
        elif backward.inside_nested_backward(self._forward_thread):
            self._nested_task = backward.current_graph_task()  # checked again when the outer backward goes on
        elif self.mode is GraphMode.FIND_UNUSED and not torch_private.hooks_run_for_undefined_gradients():
            self._ready_as_their_hooks_would_be(step)
        else:
            step.raise_not_ready(
                messages.unused_hint(self.mode is GraphMode.FIND_UNUSED, self.mode is GraphMode.STATIC)
            )

    def _ready_as_their_hooks_would_be(self, step: BackwardStep) -> None:
        """torch before 2.8 skips the hook of a parameter reached only through an undefined gradient (an output the
        loss does not use; 2.8 and later run it with ``.grad`` None). With find_unused_parameters, the parameters
        still missing at the end of the outermost backward are those: handle each as its hook would have."""
        with torch.no_grad():
            for i in [i for i, arrived in enumerate(step.ready) if not arrived]:
                self._gradient_ready(i)  # the last launch queues the finalizer, right behind this callback

    def _reduce_what_was_learned(self, step: BackwardStep) -> None:
        """static_graph's first backward ended: what fired is used, the rest is unused from now on (this rank's
        graph; the usage all-reduce tells which no rank used)."""
        assert self._static is not None
        self._agree_on_hook_once()
        step.end_learning()
        with torch.no_grad():
            for i in self._static.learned():
                step.mark_ready(i)  # the last launch queues the finalizer, right behind this callback

    def _queue_finalize(self) -> None:
        torch_private.queue_backward_callback(self._finalize)

    def _finalize(self) -> None:
        step = self._step
        if step is None or step.finished:
            return
        self._recorder.backward_end()
        try:
            with torch.no_grad():
                step.finish()
            if self._local.sharded:
                self._local.publish()
        finally:
            self._set_step(step)  # finished, or failed: later gradients accumulate locally
        self._recorder.comm_end()
        self._end_synced_backward()

    def _end_synced_backward(self) -> None:
        self.iteration += 1
        self._rebuild.backward_done()

    def _raise_if_unfinished(self) -> None:
        step = self._step
        if step is not None and step.unfinished:
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
        mine = self._reduction.identity()
        everyone = self.comm.all_gather_object(Op.HOOK_CHECK, mine)
        self._hook_agreed = True
        if len(set(everyone)) > 1:
            raise ConfigError(messages.hook_mismatch(everyone, self.comm.global_rank))
