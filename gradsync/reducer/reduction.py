"""How one bucket is reduced: gradsync's built-in all-reduce, or a registered communication hook.

One object, chosen when a hook is registered (torch's ``register_comm_hook`` contract: ``hook(state, bucket)``
returns a ``Future[Tensor]`` of the bucket's averages), so a step launches a bucket the same way either way and
never asks which.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from gradsync import torch_private
from gradsync.collectives.communicator import Communicator, Op
from gradsync.errors import ConfigError, GradientError
from gradsync.reducer import messages
from gradsync.reducer.grad_bucket import GradBucket, result_future
from gradsync.reducer.hook_order import OneAtATime, hook_needs_order

CommHook = Callable[[Any, GradBucket], torch.futures.Future]


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


class HookReduction:
    """A communication hook reduces each bucket; it averages itself, as torch's hooks do, so nothing is divided on
    the way in."""

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


BucketReduction = AllReduce | HookReduction | FiniteChecked


def checked_if(check: dict[int, str] | None, reduction: AllReduce | HookReduction) -> BucketReduction:
    """``reduction``, behind the non-finite check where ``check`` (the parameters' names by tensor id) is given."""
    return reduction if check is None else FiniteChecked(reduction, check)
