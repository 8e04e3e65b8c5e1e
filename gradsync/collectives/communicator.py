"""The one path for every collective gradsync issues: named, numbered, checked, and then issued.

Every rank must issue the same collectives in the same order with the same sizes, or gloo and NCCL pair mismatched
operations: a hang, or silently wrong numbers. gradsync keeps that true by construction: DDP, the reducer, the
bucket tuner, the join shadows, the sharded optimizer, checkpoints and local SGD all issue their collectives through
a :class:`Communicator`, which for each one

1. counts it (its place in this communicator's sequence);
2. with ``GRADSYNC_DEBUG=1``, compares a fingerprint of it across the ranks first (:mod:`.desync`);
3. issues it, and turns a backend failure (a timeout, a dead peer) into a :class:`~gradsync.errors.CollectiveError`
   that names the operation, this rank, what the other ranks reported, and who never arrived (:mod:`.peer_errors`).

A joined rank (``DistributedDataParallel.join``) shadows the others by calling the same code with zeros, so its
sequence, its fingerprints and its collectives match theirs without a hand-kept copy.
"""

from __future__ import annotations

import contextlib
import enum
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from gradsync import settings, torch_private
from gradsync.collectives import desync
from gradsync.collectives.activity import CollectiveActivity, of_this_process
from gradsync.collectives.groups import resolve
from gradsync.collectives.nccl_watch import Watch
from gradsync.collectives.peer_errors import PeerReports, report_grace
from gradsync.errors import CollectiveError, GradsyncError
from gradsync.polling import wait_until


class Op(enum.Enum):
    """Every collective gradsync issues; the value is how errors and desync reports name it."""

    MODEL_CHECK = "comparison of the model (parameters and buffers) across ranks"
    HOOK_CHECK = "comparison of the communication hooks across ranks"
    INITIAL_BROADCAST = "broadcast of rank 0's parameters and buffers at construction"
    BUFFER_BROADCAST = "broadcast of module buffers before forward"
    PLAN_BROADCAST = "broadcast of the rebuilt bucket plan"
    LINK_PROBE = "link probe of the bucket-size tuner"
    TRIAL_DECISION = "broadcast of the bucket-size trial's decision"
    BUCKET_ALLREDUCE = "all-reduce of bucket"
    JOIN_FLAGS = "all-reduce telling joined ranks which collectives this forward issues"
    USAGE_ALLREDUCE = "all-reduce of the used-parameter map"
    LAST_JOINER = "all-reduce electing the last rank to join"
    FINAL_MODEL = "broadcast of the last joiner's model"
    SHARD_ALLGATHER = "all-gather of the optimizer's updated shards"
    STATE_GATHER = "gather of the optimizer's state shards"
    SHARD_CHECK = "comparison of the optimizer's parameter lists across ranks"
    PARAMETER_AVERAGE = "all-reduce averaging the parameters"
    SYNC_BATCHNORM = "SyncBatchNorm's exchange of batch statistics"
    QUANTIZED_SCATTER = "all-to-all of a bucket's quantized chunks"
    QUANTIZED_GATHER = "all-gather of a bucket's quantized sums"
    CHECKPOINT_RNG = "gather of every rank's RNG state for a checkpoint"
    CHECKPOINT_BARRIER = "barrier after writing a checkpoint"
    MONITOR_GATHER = "gather of every rank's step records"
    ELASTIC_STATE = "broadcast of rank 0's training state to a new membership round"
    DELAYED_ALLREDUCE = "all-reduce of the delayed parameters' gradients (delay_all_reduce_named_params)"

    @property
    def code(self) -> int:
        return _CODES[self]


# How a collective is named in errors: a text, or a function that builds it only on failure.
Description = str | Callable[[], str] | None

_CODES = {op: code for code, op in enumerate(Op, start=1)}
_NAMES = {code: op.value for op, code in _CODES.items()}


class Communicator:
    """Issues gradsync's collectives on one process group (``None``: the default group, looked up at each use).

    Example::

        comm = Communicator(process_group=None, check_desync=gradsync.settings.debug())
        comm.broadcast(Op.BUFFER_BROADCAST, flat)           # named on failure, fingerprinted under GRADSYNC_DEBUG
        fut = comm.all_reduce_async(Op.BUCKET_ALLREDUCE, bucket, index=3)
        comm.wait(fut, Op.BUCKET_ALLREDUCE, index=3)
    """

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        check_desync: bool = False,
        device: torch.device | None = None,
        reports: PeerReports | None = None,
        activity: CollectiveActivity | None = None,
    ) -> None:
        self._process_group = process_group
        self.check_desync = check_desync
        # How failures reach the peers (and theirs this rank): the process's rule unless given.
        self.reports = reports if reports is not None else PeerReports.for_this_process()
        # When this rank last touched a collective, for an elastic worker's heartbeat thread (activity.py); None: none.
        self._activity = activity if activity is not None else of_this_process()
        self.device = device  # the owner's device: where object collectives stage their bytes (None: torch's choice)
        self.sequence = 0  # collectives issued so far: identical on every rank while they are in step
        self.step = 0  # the owner's synced step (DDP advances it at each synced forward), for fingerprints
        self._watch: Watch | None = None  # NCCL collectives in flight, named if they fail or hang (made at first use)

    def report(self, message: str) -> None:
        """Post ``message`` as this rank's failure for the peers (the reducer's, join's and checkpoints' failures
        reach them through their communicator); the caller raises it."""
        self.reports.post(message)

    def begin_step(self) -> None:
        """A new synced step starts (every rank calls this at the same point, joined ranks' shadows included)."""
        self.step += 1
        if self.check_desync:
            self.reports.post_step(self.step)

    @property
    def group(self) -> dist.ProcessGroup:
        return resolve(self._process_group)

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    def global_rank(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank)

    # --------------------------------------------------------------------------------------------- collectives
    def broadcast(self, op: Op, tensor: torch.Tensor, src: int = 0, index: int = -1, what: Description = None) -> None:
        """Overwrite ``tensor`` with group rank ``src``'s. ``what``, if given, describes it in errors (lazily)."""
        with self._issuing(op, index, tensor, what):
            work = dist.broadcast(tensor, src=self.global_rank(src), group=self.group, async_op=True)
            self._watched(work, op, index, what, tensor).wait()

    def all_reduce(self, op: Op, tensor: torch.Tensor, index: int = -1, reduce_op: Any = dist.ReduceOp.SUM) -> None:
        with self._issuing(op, index, tensor):
            work = dist.all_reduce(tensor, op=reduce_op, group=self.group, async_op=True)
            self._watched(work, op, index, None, tensor).wait()

    def all_reduce_async(self, op: Op, tensor: torch.Tensor, index: int = -1) -> torch.futures.Future:
        """Start summing ``tensor`` in place; :meth:`wait` on the returned future."""
        if self.check_desync or tensor.is_complex():
            with self._issuing(op, index, tensor):
                work = dist.all_reduce(tensor, group=self.group, async_op=True)
                return self._watched(work, op, index, None, tensor).get_future()
        # Every bucket of every backward comes here: the process group's own allreduce, as torch's C++ reducer
        # calls it, without dist.all_reduce's per-call checks (a bucket is one dense real tensor, of a group this
        # rank is in, outside any coalescing block) nor a context manager, whose Python would run on every bucket's
        # path (docs/scaling.md measures the reducer's CPU per backward).
        self.sequence += 1
        try:
            work = self.group.allreduce([tensor], _SUM_ASYNC)
        except Exception as exc:
            raise self._failure(op, index, None, exc) from exc
        return self._watched(work, op, index, None, tensor).get_future()

    def all_to_all_async(self, op: Op, output: torch.Tensor, tensor: torch.Tensor, index: int = -1) -> Any:
        """Start sending the r-th equal slice of ``tensor`` to group rank r, receiving theirs into ``output``."""
        with self._issuing(op, index, tensor):
            work = dist.all_to_all_single(output, tensor, group=self.group, async_op=True)
            return self._watched(work, op, index, None, tensor)

    def all_gather_async(self, op: Op, outputs: list[torch.Tensor], tensor: torch.Tensor, index: int = -1) -> Any:
        """Start gathering every rank's ``tensor`` into ``outputs`` (group-rank order)."""
        with self._issuing(op, index, tensor):
            work = dist.all_gather(outputs, tensor, group=self.group, async_op=True)
            return self._watched(work, op, index, None, tensor)

    def all_gather(self, op: Op, tensor: torch.Tensor, what: Description = None) -> list[torch.Tensor]:
        """Every rank's ``tensor`` (same shape on every rank), in group-rank order."""
        out = [torch.empty_like(tensor) for _ in range(self.size)]
        with self._issuing(op, -1, tensor, what):
            work = dist.all_gather(out, tensor, group=self.group, async_op=True)
            self._watched(work, op, -1, what, tensor).wait()
        return out

    def all_gather_object(self, op: Op, obj: Any) -> list[Any]:
        """Every rank's picklable ``obj``, in group-rank order."""
        out: list[Any] = [None] * self.size
        with self._issuing(op, -1, None), self._objects_on_own_device():
            dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast_object(self, op: Op, obj: Any, src: int = 0) -> Any:
        """Group rank ``src``'s picklable ``obj``, on every rank."""
        holder = [obj]
        with self._issuing(op, -1, None), self._objects_on_own_device():
            dist.broadcast_object_list(holder, src=self.global_rank(src), group=self.group)
        return holder[0]

    def _objects_on_own_device(self) -> contextlib.AbstractContextManager:
        """torch's object collectives stage their pickled bytes on ``torch.cuda.current_device()`` under NCCL: a model
        on cuda:r wrapped without ``torch.cuda.set_device(r)`` (torch's DDP accepts that) would put every rank's
        bytes on cuda:0, a duplicate-GPU NCCL error or a hang. They use the owner's device instead."""
        if self.device is None or self.device.type != "cuda":
            return contextlib.nullcontext()
        return torch.cuda.device(self.device)

    def barrier(self, op: Op) -> None:
        with self._issuing(op, -1, None):
            dist.barrier(group=self.group)

    def expect_everyone(self, op: Op, seconds: float, call: str) -> None:
        """Before a collective that only some ranks might reach (``if rank == 0: checkpoint.save(...)``): wait at
        most ``seconds`` for every rank to arrive here, through the store, and otherwise fail naming the ranks that
        did not and the function (``call``) every rank must call, instead of blocking until the timeout."""
        self.sequence += 1
        store = torch_private.default_store()
        ranks = [self.global_rank(r) for r in range(self.size)]
        prefix = f"gradsync/arrive/{'-'.join(map(str, ranks))}/{op.code}/{self.sequence}/"
        store.set(prefix + str(dist.get_rank()), "1")
        not_arrived = lambda: [r for r in ranks if not store.check([prefix + str(r)])]  # noqa: E731
        wait_until(lambda: not not_arrived(), seconds, pause=0.01, max_pause=0.05)
        missing = not_arrived()
        if missing:
            message = (
                f"{op.value}: rank(s) {missing} did not reach {call} within {seconds:.0f}s (this is rank "
                f"{dist.get_rank()}). Every rank must call {call}, not only rank 0: it is a collective."
            )
            self.reports.post(message)
            raise CollectiveError(message)

    def timed_all_reduce(self, op: Op, tensor: torch.Tensor) -> float:
        """Seconds one all-reduce of ``tensor`` takes (the desync check, if on, runs before the clock starts)."""
        with self._issuing(op, -1, tensor):
            _synchronize(tensor.device)
            start = time.perf_counter()
            dist.all_reduce(tensor, group=self.group)
            _synchronize(tensor.device)  # NCCL returns once enqueued; the time that matters is the stream's
            return time.perf_counter() - start

    def launch(
        self, op: Op, index: int, tensor: torch.Tensor, start: Callable[[], torch.futures.Future]
    ) -> torch.futures.Future:
        """Issue a collective that ``start`` makes (a communication hook's), counted and checked like the others."""
        with self._issuing(op, index, tensor):
            return start()

    def wait(
        self, future: torch.futures.Future, op: Op, index: int = -1, what: Description = None, bounded: bool = False
    ) -> Any:
        """The future's value; a failure is named like a failed collective (``what`` describes it, lazily).
        ``bounded``: a future the backend's timeout does not cover (a communication hook's own) fails after the
        process group's timeout instead of blocking forever."""
        # try/except rather than _named's context manager: every bucket of every backward is waited for here.
        activity = self._activity
        if activity is not None:
            activity.enter()
        try:
            if bounded and not future.done():
                self._wait_until_done(future)
            return future.wait()
        except GradsyncError:
            raise
        except Exception as exc:
            raise self._failure(op, index, what, exc) from exc
        finally:
            if activity is not None:
                activity.leave()

    def _wait_until_done(self, future: torch.futures.Future) -> None:
        timeout = self.timeout_seconds()
        # At most 1 ms late: a hook's future is on the critical path.
        if not wait_until(future.done, timeout, pause=1e-4, max_pause=1e-3):
            raise TimeoutError(
                f"the future did not complete within the process group's timeout ({timeout:.0f}s); a "
                "communication hook must return a future that completes (e.g. from an async collective)"
            )

    def timeout_seconds(self) -> float:
        """The process group's collective timeout (gloo and NCCL enforce it on their own collectives), read from the
        backend that serves the owner's device: NCCL's for a CUDA model, not the CPU side's."""
        for device in dict.fromkeys(d for d in (self.device, torch.device("cpu")) if d is not None):
            seconds = torch_private.backend_timeout_seconds(self.group, device)
            if seconds is not None:  # else no backend for this device, or one that does not say
                return seconds
        return settings.timeout_seconds(600.0)  # gradsync's own default

    # ---------------------------------------------------------------------------------------- NCCL's side
    def _watched(self, work: Any, op: Op, index: int, what: Description, tensor: torch.Tensor) -> Any:
        """``work``, handed to the NCCL watch first when it runs on NCCL (see :mod:`.nccl_watch`)."""
        if tensor.is_cuda and work is not None and self._on_nccl():
            if self._watch is None:
                self._watch = Watch(self.timeout_seconds(), self._report_nccl_problem)
            self._watch.add(work, lambda: _collective_text(op, index, what))
        return work

    def futures_complete_when_issued(self) -> bool:
        """Whether a bucket collective's future completes as it is issued, its callbacks run on the issuing thread:
        NCCL's do (``ProcessGroupNCCL`` marks the future complete once the kernel is queued, the stream ordering the
        rest), gloo's complete later on the backend's worker threads."""
        return self.device is not None and self.device.type == "cuda" and self._on_nccl()

    def _on_nccl(self) -> bool:
        return "nccl" in str(dist.get_backend(self.group))

    def _report_nccl_problem(self, text: str, reason: str) -> None:
        """From the watch's thread: say, as gloo's errors say, what failed or hangs, and post it for the peers."""
        message = f"{text} failed on rank {dist.get_rank()}: {reason}"
        self.reports.post(message)
        step = self.step if self.check_desync else None
        print(
            f"gradsync: {message}{self.reports.describe(grace=2.0, collective=text, step=step)}\n  The ranks that "
            "reported nothing never issued this collective: look at what they were doing (their stacks: py-spy "
            "dump --pid PID). Rerun with GRADSYNC_DEBUG=1 to compare every collective across the ranks first.",
            file=sys.stderr,
            flush=True,
        )

    # ------------------------------------------------------------------------------------------------ helpers
    @contextlib.contextmanager
    def _issuing(self, op: Op, index: int, tensor: torch.Tensor | None, what: Description = None) -> Iterator[None]:
        self.sequence += 1
        with self._named(op, index, what), self._activity.inside() if self._activity else _NOT_WATCHED:
            # The model check carries the settings (GRADSYNC_DEBUG among them): it runs unfingerprinted, so that a
            # rank with debug on meets a rank with debug off in the same collective and both can name the flag.
            if self.check_desync and op is not Op.MODEL_CHECK:
                fingerprint = desync.Fingerprint.of(op.code, self.step, self.sequence, index, tensor)
                desync.check(self.group, fingerprint, self._device(tensor), _NAMES)
            yield

    @contextlib.contextmanager
    def _named(self, op: Op, index: int, what: Description) -> Iterator[None]:
        try:
            yield
        except GradsyncError:
            raise  # already named (a desync report, a failure inside a nested collective)
        except Exception as exc:
            raise self._failure(op, index, what, exc) from exc

    def _failure(self, op: Op, index: int, what: Description, exc: Exception) -> Exception:
        """``exc``, raised by a collective, as the error that names it, the rank, and what the peers reported."""
        text = _collective_text(op, index, what)
        message = f"{text} failed on rank {dist.get_rank()}: {exc}"
        self.reports.post(message)
        # Said at once: a launcher may stop this process during the wait for the peers' reports below.
        print(f"gradsync: {message}", file=sys.stderr, flush=True)
        step = self.step if self.check_desync else None
        grace = report_grace(exc)
        return CollectiveError(message + self.reports.describe(grace=grace, collective=text, step=step))

    def _device(self, tensor: torch.Tensor | None) -> torch.device:
        if tensor is not None:
            return tensor.device
        if self.device is not None:
            return self.device
        if dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


_NOT_WATCHED = contextlib.nullcontext()  # no activity record outside an elastic worker: one reusable no-op


def _sum_async_options() -> dist.AllreduceOptions:
    options = dist.AllreduceOptions()  # its reduceOp is SUM by default, as dist.all_reduce's op
    if hasattr(options, "asyncOp"):  # torch 2.8 and later: dist.all_reduce(async_op=True) sets it so
        options.asyncOp = True
    return options


_SUM_ASYNC = _sum_async_options()


def _collective_text(op: Op, index: int, what: Description) -> str:
    """How errors name a collective: ``what`` (a text, or a function building it), else the operation and index."""
    if callable(what):
        return what()
    return what or op.value + (f" {index}" if index >= 0 else "")


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
