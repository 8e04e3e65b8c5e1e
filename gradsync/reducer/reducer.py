"""The fast reducer: gradient hooks → bucket → asynchronous all-reduce, overlapped with backward.

The path of one gradient (DESIGN.md; Li et al., VLDB 2020, section 3.2): autograd accumulates ``param.grad`` and
fires the parameter's post-accumulate-grad hook; the hook copies the gradient into its bucket slot; when a bucket
is full and every earlier bucket has been launched, its communication hook runs (an async all-reduce by default),
so communication overlaps the rest of backward. One callback queued on the autograd engine waits for every bucket
at the end of backward and writes the averages back, so ``.grad`` is final when ``backward()`` returns.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from gradsync import desync
from gradsync.comm.grad_bucket import GradBucket
from gradsync.groups import rank0_global
from gradsync.peer_errors import named_collective, post_error
from gradsync.reducer import autotune, messages
from gradsync.reducer.buckets import Bucket, assign_buckets, quiet_parameters, size_limits, write_back
from gradsync.reducer.unused import GlobalUsage

CommHook = Callable[[Any, GradBucket], torch.futures.Future]


class _Phase(enum.Enum):
    IDLE = "idle"  # no synced forward prepared: hooks let gradients accumulate locally (no_sync)
    PREPARED = "prepared"  # a synced forward ran; the next backward reduces
    REDUCING = "reducing"  # inside that backward
    FINISHED = "finished"  # reduced; a second backward before the next forward is an error


class Reducer:
    """Averages the gradients of ``params`` across ``process_group`` during backward.

    Used by :class:`gradsync.DistributedDataParallel`; call :meth:`prepare_for_backward` after each forward whose
    backward should synchronise. ``names[i]`` names ``params[i]`` in error messages.
    """

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        names: Sequence[str],
        process_group: dist.ProcessGroup | None,
        bucket_cap_mb: float | str | Sequence[float] | None = None,
        gradient_as_bucket_view: bool = False,
        find_unused_parameters: bool = False,
        static_graph: bool = False,
    ) -> None:
        self.params = list(params)
        self.names = list(names)
        self._process_group = process_group  # None: the default group, looked up at each use
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.size_limits = size_limits(bucket_cap_mb)
        self.tune_buckets = autotune.tuning_enabled(bucket_cap_mb)
        self.tuning: autotune.BucketTuning | None = None  # the tuner's decision, once made
        self.usage = GlobalUsage(len(self.params), find_unused_parameters, static_graph)
        # With a dynamic graph the ready order changes between iterations, so torch never rebuilds then.
        self.rebuild_allowed = static_graph or not find_unused_parameters
        self.comm_state: Any = process_group
        # None: the built-in averaging (divide on the way into the bucket, one plain all-reduce), torch's C++ path.
        self.comm_hook: CommHook | None = None
        self.observer = None  # a gradsync.observe StepRecorder, fed only while one is attached
        self.grad_scale = 1.0  # applied to the averages (join with divide_by_initial_world_size=False)
        # Called with each bucket as soon as its averages are in .grad, while later buckets may still be in flight
        # (gradsync.optim.OverlappedOptimizer steps that bucket's parameters there).
        self.bucket_reduced: Callable[[Bucket], None] | None = None
        self.iteration = 0  # synced backward passes completed
        self.synced_steps = 0  # synced forwards prepared (the step number desync fingerprints carry)
        self.check_desync = False  # GRADSYNC_DEBUG: compare fingerprints before each collective
        self.rebuilt = False
        self._rebuild_pending = False
        self._ready_order: list[int] = []
        self._unused: Sequence[int] = ()
        self._ready_times: list[float] = []  # perf_counter() of each _ready_order entry (the tuner's timeline)
        self._backward_start = 0.0
        self._phase = _Phase.IDLE
        self._build(list(reversed(range(len(self.params)))))
        self._handles = [p.register_post_accumulate_grad_hook(self._make_hook(i)) for i, p in enumerate(self.params)]

    # ----------------------------------------------------------------------------------------------- buckets
    def _build(self, order: Sequence[int]) -> None:
        groups = assign_buckets(self.params, order, self.size_limits)
        self.buckets = [Bucket(k, g, self.params) for k, g in enumerate(groups)]
        self._bucket_of: list[Bucket] = [None] * len(self.params)  # type: ignore[list-item]
        self._slot_of = [0] * len(self.params)
        for bucket in self.buckets:
            for slot, i in enumerate(bucket.param_indices):
                self._bucket_of[i] = bucket
                self._slot_of[i] = slot
        # Bucket order, flattened: the write-back is one fused copy over these.
        self._flat_params = [p for b in self.buckets for p in b.params]
        self._flat_views = [v for b in self.buckets for v in b.views]
        self._flat_indices = [i for b in self.buckets for i in b.param_indices]
        if self.gradient_as_bucket_view:  # keep accumulated values, but from now on .grad lives in the bucket
            for bucket in self.buckets:
                for view, i in zip(bucket.views, bucket.param_indices):
                    p = self.params[i]
                    if p.grad is not None:
                        view.copy_(p.grad)
                        p.grad = view

    def rebuild_buckets_if_pending(self) -> bool:
        """Rebuild once, after the first synced iteration, from the observed ready order (rank 0's everywhere).

        Gradients become ready in execution order, not registration order; bucketing in that order lets each
        bucket launch as early as possible (Li et al., section 3.2.3). Every rank must build identical buckets or
        their collectives would not match, hence the broadcast. Called at a forward, when all ranks are in step.
        With tuning on, the bucket caps are chosen here too, from iteration 1's timeline (:mod:`.autotune`).
        """
        if not self._rebuild_pending:
            return False
        seen = set(self._ready_order)
        order = self._ready_order + [i for i in reversed(range(len(self.params))) if i not in seen]
        device = self.params[0].device
        plan = torch.tensor(order + self.size_limits, dtype=torch.int64, device=device)
        if self.check_desync:
            desync.check(self._process_group, desync.BROADCAST_REBUILD, self.synced_steps + 1, 0, plan)
        if self.tune_buckets and dist.get_world_size(self._process_group) > 1:  # all probe; rank 0 decides
            times = (self._ready_order, self._ready_times, self._backward_start)
            self.tuning = autotune.tune(self._process_group, self.params, order, times, self.size_limits)
            plan = torch.tensor(order + self.tuning.size_limits, dtype=torch.int64, device=device)
        with named_collective("broadcast of the rebuilt bucket order"):
            dist.broadcast(plan, src=rank0_global(self._process_group), group=self._process_group)
        values = plan.tolist()
        self.size_limits = values[len(order) :]
        if self.tuning is not None:  # rank 0's choice is what applies on this rank too
            self.tuning = dataclasses.replace(self.tuning, size_limits=self.size_limits)
        self._build(values[: len(order)])
        if self.usage.static and self._ready_order and not self._unused and not self.check_desync:
            for bucket in self.buckets:  # one hook per bucket's small parameters, by this rank's own ready order
                bucket.quiet = quiet_parameters(bucket, order)
                for i in bucket.quiet:
                    self._handles[i].remove()
        self._rebuild_pending = False
        self.rebuilt = True
        return True

    def request_rebuild(self) -> None:
        """Take part in the one-time rebuild at the next forward (a joined rank: see gradsync.join)."""
        self._rebuild_pending = True

    # ----------------------------------------------------------------------------------------------- per step
    def prepare_for_backward(self, unused: Sequence[int] = ()) -> None:
        """Arm the next backward to reduce; ``unused`` parameters are counted ready with their current grad."""
        for bucket in self.buckets:
            bucket.reset()
        self._ready = bytearray(len(self.params))
        self._used = self.usage.local_map()
        self._futures: list[torch.futures.Future | None] = [None] * len(self.buckets)
        self._next_launch = 0
        self._unused = unused
        self._record_order = self.rebuild_allowed and not self.rebuilt and self.iteration == 0
        self._phase = _Phase.PREPARED
        self.synced_steps += 1
        self._divisor = dist.get_world_size(self._process_group) if self.comm_hook is None else None

    def skip_next_backward(self) -> None:
        """Let the next backward accumulate gradients locally (no_sync / require_backward_grad_sync=False)."""
        self._phase = _Phase.IDLE

    def _make_hook(self, index: int) -> Callable[[torch.Tensor], None]:
        # The hot path: runs once per parameter per backward, so it only counts; copies happen per bucket.
        def hook(_param: torch.Tensor) -> None:
            if self._phase is not _Phase.REDUCING and not self._enter_backward(index):
                return
            if self._used is not None:
                self._used[index] = 1
            if self.observer is not None:
                self.observer.poll()
            self._mark_ready(index)

        return hook

    def _enter_backward(self, index: int) -> bool:
        """First hook of a backward: False to let it accumulate locally, True after arming the reduction."""
        if self._phase is _Phase.IDLE:
            return False
        if self._phase is _Phase.FINISHED:
            raise RuntimeError(messages.backward_after_reduction(self.names[index]))
        self._phase = _Phase.REDUCING
        self._backward_start = time.perf_counter()
        torch.autograd.Variable._execution_engine.queue_callback(self._finalize)
        if self.observer is not None:
            self.observer.backward_start(self.buckets)
        for j in self._unused:
            self._mark_ready(j)
        return True

    def _mark_ready(self, i: int) -> None:
        if self._ready[i]:
            raise RuntimeError(messages.ready_twice(self.names[i]))
        self._ready[i] = 1
        if self._record_order:
            self._ready_order.append(i)
            self._ready_times.append(time.perf_counter())
        bucket = self._bucket_of[i]
        slot = self._slot_of[i]
        if bucket.eager[slot]:  # large gradients go in as they arrive; small ones together when the bucket fills
            if self.gradient_as_bucket_view:
                bucket.adopt_grad(slot, self._divisor)
            else:
                bucket.copy_grad(slot, self._divisor)
        bucket.pending -= 1
        if bucket.pending == 0:
            for j in bucket.quiet:
                self._ready[j] = 1
                if self._used is not None:
                    self._used[j] = 1
            bucket.gather_small_grads(self._divisor, self.gradient_as_bucket_view)
            if self.observer is not None:
                self.observer.bucket_ready(bucket.index)
            if bucket.index == self._next_launch:
                self._launch_ready_buckets()

    def _launch_ready_buckets(self) -> None:
        # Strictly in bucket order: every rank must issue identical collectives in an identical sequence.
        buckets = self.buckets
        while self._next_launch < len(buckets) and buckets[self._next_launch].pending == 0:
            k = self._next_launch
            bucket = buckets[k]
            if self.check_desync:
                desync.check(self._process_group, desync.ALLREDUCE_BUCKET, self.synced_steps, k, bucket.buffer)
            fut = self.reduce_async(k, bucket.buffer, bucket.views)
            self._futures[k] = fut
            self._next_launch += 1
            if self.observer is not None:
                self.observer.bucket_launched(k, fut)
        if self._next_launch == len(buckets) and self._used is not None:
            if self.check_desync:
                used = torch.tensor(list(self._used), dtype=torch.int32, device=self.params[0].device)
                desync.check(self._process_group, desync.ALLREDUCE_USED, self.synced_steps, 0, used)
            self.usage.start(self._used, self._process_group, self.params[0].device)

    def reduce_async(self, k: int, buffer: torch.Tensor, views: list[torch.Tensor]) -> torch.futures.Future:
        """Start reducing bucket ``k``'s ``buffer`` (the join shadow passes zeros): the communication hook, or the
        built-in all-reduce of gradients already divided by the world size."""
        if self.comm_hook is None:
            return dist.all_reduce(buffer, group=self._process_group, async_op=True).get_future()
        # A fresh GradBucket each launch: hooks may set_buffer() on it, as in torch.
        params = self.buckets[k].params
        fut = self.comm_hook(self.comm_state, GradBucket(k, buffer, views, params, k == len(self.buckets) - 1))
        if not isinstance(fut, torch._C.Future):  # torch.futures.Future and what .then() returns
            raise TypeError(
                f"gradsync: communication hook {getattr(self.comm_hook, '__name__', self.comm_hook)!r} returned "
                f"{type(fut).__name__} for bucket {k}; it must return a torch.futures.Future[torch.Tensor]."
            )
        return fut

    def _finalize(self) -> None:
        self._phase = _Phase.FINISHED
        if self.observer is not None:
            self.observer.backward_end()
        if self._next_launch < len(self.buckets):
            self._raise_not_ready()
        for k, fut in enumerate(self._futures):
            bucket = self.buckets[k]
            with named_collective(lambda k=k: f"all-reduce of {self.describe_bucket(k)}"):
                result = fut.wait()  # type: ignore[union-attr]
            if isinstance(result, list):  # the built-in all-reduce's future holds [tensor]
                result = result[0]
            if result.data_ptr() != bucket.buffer.data_ptr():
                bucket.buffer.copy_(result.view_as(bucket.buffer))
            if self.bucket_reduced is not None:  # usage tracking is refused with it: no globally-used map here
                if self.grad_scale != 1.0:
                    bucket.buffer.mul_(self.grad_scale)
                write_back(None, bucket.params, bucket.views, bucket.param_indices, self.gradient_as_bucket_view)
                self.bucket_reduced(bucket)
        # Hold no finished futures or works past this point: gloo work objects that outlive the process group
        # are destroyed during interpreter teardown and abort the process ("terminate called ...").
        self._futures = []
        globally_used = self.usage.result()
        if self.bucket_reduced is None:
            if self.grad_scale != 1.0:
                torch._foreach_mul_([b.buffer for b in self.buckets], self.grad_scale)
            write_back(
                globally_used, self._flat_params, self._flat_views, self._flat_indices, self.gradient_as_bucket_view
            )
        if self.observer is not None:
            self.observer.comm_end()
        self.iteration += 1
        if self._record_order:
            self._rebuild_pending = True

    # ----------------------------------------------------------------------------------------------- errors
    def describe_bucket(self, k: int) -> str:
        return messages.bucket_description(self.buckets[k], len(self.buckets), self.names)

    def _raise_not_ready(self) -> None:
        missing = [self.names[i] for i in range(len(self.params)) if not self._ready[i]]
        message = messages.no_gradient(dist.get_rank(), missing)
        post_error(message)
        raise RuntimeError(f"gradsync: {message}")
