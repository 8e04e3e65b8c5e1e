"""DistributedDataParallel: construction, forward, no_sync, join and comm hooks around gradsync's own reducer.

A drop-in for ``torch.nn.parallel.DistributedDataParallel``: same class name, argument names and meanings, so a
training script changes one import. The gradient averaging itself lives in :mod:`gradsync.reducer`; every
collective goes through the model's :class:`~gradsync.collectives.Communicator`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from gradsync import settings
from gradsync.collectives.communicator import Communicator, Op
from gradsync.collectives.tensors import broadcast_tensors
from gradsync.ddp.replicas import broadcast_initial_state, verify_same_model
from gradsync.ddp.tree import iter_tensors, map_tensors
from gradsync.errors import ConfigError
from gradsync.observe.recorder import Recorder
from gradsync.reducer.mode import GraphMode
from gradsync.reducer.reducer import CommHook, Reducer
from gradsync.reducer.unused import unused_parameter_indices

# torch arguments gradsync accepts only at their defaults (None / False).
_UNSUPPORTED = (
    "delay_all_reduce_named_params",
    "param_to_hook_all_reduce",
    "mixed_precision",
    "device_mesh",
    "skip_all_reduce_unused_params",
)


class DistributedDataParallel(nn.Module, Joinable):
    """Data parallelism: each process holds a replica of ``module``; gradients are averaged during backward.

    Arguments mean what they mean for torch's DDP (2.13's signature, including ``forward_sync_buffers`` and
    ``bucket_cap_mb_list``). One difference by design: with ``bucket_cap_mb=None`` gradsync starts from torch's
    caps and, at the bucket rebuild after iteration 1, may propose smaller ones from the measured backward timeline
    and link speed, keeping them only if real steps confirm they are faster (:mod:`gradsync.reducer.rebuild`;
    ``"auto"`` asks for it explicitly, ``GRADSYNC_BUCKET_TUNING=0`` or any number turns it off).
    ``batched_grad_copy`` is accepted and always on: small gradients are copied into their bucket with one fused
    copy. After ``loss.backward()`` returns, every parameter's ``.grad`` holds the average over the process group,
    so ``optimizer.step()`` keeps all replicas identical and training equals one process training on all ranks'
    batches at once.

    Example::

        dist.init_process_group("gloo")
        model = gradsync.DistributedDataParallel(MyModel())
        loss = loss_fn(model(x), y)
        loss.backward()          # gradients are averaged across ranks here
        optimizer.step()

    ``state_dict()`` keys carry the ``module.`` prefix, as torch's do; :meth:`module_state_dict` and
    :meth:`load_module_state_dict` read and write the unprefixed state of the wrapped model.
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: Sequence[int | torch.device] | None = None,
        output_device: int | torch.device | None = None,
        dim: int = 0,
        broadcast_buffers: bool | None = None,
        init_sync: bool = True,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float | str | None = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        *,
        bucket_cap_mb_list: Sequence[float] | None = None,
        batched_grad_copy: bool = False,
        forward_sync_buffers: bool | None = None,
        **unsupported: Any,
    ) -> None:
        super().__init__()
        Joinable.__init__(self)
        _refuse_unsupported(unsupported)
        named = _trainable_parameters(module)
        self.module = module
        self._process_group = process_group  # None: the default group, looked up at each use
        self.device_ids, self.output_device = _device_indices(device_ids, output_device)
        self.dim = dim
        self.forward_sync_buffers, init_sync_buffers = _buffer_sync(broadcast_buffers, forward_sync_buffers)
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        self.batched_grad_copy = batched_grad_copy
        self.require_backward_grad_sync = True
        self._comm = Communicator(process_group, check_desync=settings.debug())
        self._mode = GraphMode.from_flags(find_unused_parameters, static_graph)
        self._join_divides_by_initial_world_size = True
        self._static_unused: list[int] | None = None
        self._recorder = Recorder()
        verify_same_model(self._comm, module)
        if init_sync:
            broadcast_initial_state(self._comm, module, include_buffers=init_sync_buffers)
        self._buffers_to_sync = list(module.buffers())
        self._params = [p for _, p in named]
        cap = list(bucket_cap_mb_list) if bucket_cap_mb_list else bucket_cap_mb
        names = [n for n, _ in named]
        self.reducer = Reducer(self._params, names, self._comm, cap, gradient_as_bucket_view, self._mode)
        self._comm_hook_registered = False

    @property
    def broadcast_buffers(self) -> bool:
        """torch's older name for :attr:`forward_sync_buffers` (buffers broadcast from rank 0 at each forward)."""
        return self.forward_sync_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value: bool) -> None:
        self.forward_sync_buffers = value

    @property
    def process_group(self) -> dist.ProcessGroup:
        """The group gradients are averaged over (the default group unless one was passed)."""
        return self._comm.group

    @property
    def communicator(self) -> Communicator:
        """The path every collective of this model takes (a Monitor or local SGD issue theirs through it too)."""
        return self._comm

    # ------------------------------------------------------------------------------------------------- forward
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        synced = torch.is_grad_enabled() and self.require_backward_grad_sync
        scale = 1.0
        if synced:
            self._recorder.forward_start()
            scale = self._join_scale()
            self._sync_before_forward()
        if self.device_ids is not None:
            device = torch.device(self._params[0].device.type, self.device_ids[0])
            inputs, kwargs = map_tensors(lambda t: t.to(device, non_blocking=True), (inputs, kwargs))
        output = self.module(*inputs, **kwargs)
        if synced:
            self._recorder.forward_end()
            self.reducer.prepare_for_backward(self._unused_parameters(output), scale)
        elif torch.is_grad_enabled():
            self.reducer.skip_next_backward()
        return output

    def _sync_before_forward(self) -> None:
        """The collectives of a synced forward, in order (a joined rank's shadow runs this same method)."""
        # Before the forward, when memory is lowest and all ranks are at the same point (torch does the same).
        self._comm.begin_step()
        self.reducer.before_synced_forward()
        if self.forward_sync_buffers and self._buffers_to_sync and self._comm.size > 1:
            broadcast_tensors(self._comm, Op.BUFFER_BROADCAST, self._buffers_to_sync)

    def _unused_parameters(self, output: Any) -> list[int]:
        if self._mode is GraphMode.FIND_UNUSED:
            return unused_parameter_indices(iter_tensors(output), self._params)
        if self._mode is GraphMode.STATIC:  # the first iteration's graph stands for all later ones
            if self._static_unused is None:
                self._static_unused = unused_parameter_indices(iter_tensors(output), self._params)
            return self._static_unused
        return []

    # ------------------------------------------------------------------------------------------- sync control
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally in the backward passes run inside; the next synced one averages the sum.

        >>> with ddp.no_sync():
        ...     ddp(x1).sum().backward()   # local only
        >>> ddp(x2).sum().backward()       # averages grads of x1 and x2  # doctest: +SKIP
        """
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    # ---------------------------------------------------------------------------------------- uneven inputs
    def join(
        self,
        divide_by_initial_world_size: bool = True,
        enable: bool = True,
        throw_on_early_termination: bool = False,
    ) -> Join:
        """Context manager for ranks with different numbers of batches (torch's ``DistributedDataParallel.join``).

        A rank that finishes its data early keeps answering the others' collectives with zeros until every rank is
        done; then all replicas take the last rank's model. Averages divide by the initial world size (default) or
        by the ranks still training. ``no_sync()`` works inside: its micro-batches run no collective to shadow.

        >>> with ddp.join():
        ...     for x, y in my_uneven_shard:
        ...         opt.zero_grad(); loss_fn(ddp(x), y).backward(); opt.step()  # doctest: +SKIP
        """
        return Join(
            [self], enable, throw_on_early_termination, divide_by_initial_world_size=divide_by_initial_world_size
        )

    def join_hook(self, **kwargs: Any) -> JoinHook:
        self._join_divides_by_initial_world_size = kwargs.get("divide_by_initial_world_size", True)
        return _DDPJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        return self._params[0].device

    @property
    def join_process_group(self) -> dist.ProcessGroup:
        return self.process_group

    def _join_scale(self) -> float:
        """Inside ``join()``: tell the joined ranks this one still trains (their loop waits on torch's Join
        all-reduce), and return what the averages must be multiplied by."""
        work = Join.notify_join_context(self)
        if work is None or self._join_divides_by_initial_world_size:
            return 1.0
        work.wait()
        active = work.result()[0].item()
        return self._comm.size / active

    def shadow_synced_step(self) -> None:
        """A joined rank, while others still train: this step's collectives, with zeros for its gradients. The
        same methods a training rank runs, so the sequences match by construction (GRADSYNC_DEBUG included)."""
        self._sync_before_forward()
        self.reducer.shadow_backward()

    def sync_final_model(self, is_last_joiner: bool) -> None:
        """After everyone joined: the last joiner trained longest, so its model becomes everyone's."""
        candidate = torch.tensor([self._comm.rank if is_last_joiner else -1], device=self.join_device)
        self._comm.all_reduce(Op.LAST_JOINER, candidate, reduce_op=dist.ReduceOp.MAX)
        state = [p.detach() for p in self.module.parameters()] + list(self.module.buffers())
        broadcast_tensors(self._comm, Op.FINAL_MODEL, state, src=int(candidate.item()))

    # ------------------------------------------------------------------------------------------ extensions
    def register_comm_hook(self, state: object, hook: CommHook) -> None:
        """Replace how each bucket is reduced; same contract as torch's ``register_comm_hook``.

        ``hook(state, bucket) -> torch.futures.Future[torch.Tensor]``; the future's value becomes the bucket's
        averaged gradients. Register once, before the first backward.
        """
        if not callable(hook):
            raise TypeError(f"register_comm_hook: hook must be callable, got {type(hook).__name__}")
        if self._comm_hook_registered:
            raise ConfigError("register_comm_hook: a communication hook is already registered; register only once.")
        if self.reducer.iteration > 0:
            raise ConfigError("register_comm_hook: register the hook before the first backward pass.")
        self.reducer.set_comm_hook(state, hook)
        self._comm_hook_registered = True

    def attach_recorder(self, recorder: Recorder) -> None:
        """Report this model's step events to ``recorder`` (what :class:`gradsync.observe.Monitor` does)."""
        self._recorder = recorder
        self.reducer.attach_recorder(recorder)

    def detach_recorder(self) -> None:
        self._recorder = Recorder()
        self.reducer.detach_recorder()

    # ---------------------------------------------------------------------------------------------- state
    def module_state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The wrapped model's state dict, without the ``module.`` prefix (what a plain model loads)."""
        return self.module.state_dict(*args, **kwargs)

    def load_module_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> Any:
        """Load an unprefixed state dict (from a plain model or :meth:`module_state_dict`) into the wrapped model."""
        return self.module.load_state_dict(state_dict, strict=strict)


class _DDPJoinHook(JoinHook):
    """What a joined rank does for gradsync's DDP (torch's Join calls it): shadow each step, then adopt the final
    model. The logic lives next to what it shadows, in DistributedDataParallel and the reducer."""

    def __init__(self, ddp: DistributedDataParallel) -> None:
        self.ddp = ddp

    def main_hook(self) -> None:
        self.ddp.shadow_synced_step()

    def post_hook(self, is_last_joiner: bool) -> None:
        self.ddp.sync_final_model(is_last_joiner)


def _refuse_unsupported(unsupported: Mapping[str, Any]) -> None:
    for name, value in unsupported.items():
        if name in _UNSUPPORTED and value in (None, False):
            continue
        hint = "gradsync does not implement it yet" if name in _UNSUPPORTED else "torch's DDP has no such argument"
        raise TypeError(f"gradsync.DistributedDataParallel: unexpected argument '{name}' ({hint})")


def _trainable_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    if not isinstance(module, nn.Module):
        raise TypeError(f"gradsync.DistributedDataParallel wraps an nn.Module, got {type(module).__name__}")
    if not dist.is_available() or not dist.is_initialized():
        raise ConfigError(
            "DistributedDataParallel needs an initialised process group: call gradsync.init() or "
            "torch.distributed.init_process_group(...) before wrapping the model."
        )
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    if not named:
        raise ConfigError(
            "DistributedDataParallel: the module has no parameter that requires grad, so there is nothing to "
            "synchronise. Wrap a module with trainable parameters (or do not wrap this one)."
        )
    return named


def _buffer_sync(broadcast_buffers: bool | None, forward_sync_buffers: bool | None) -> tuple[bool, bool]:
    """(sync buffers before each synced forward, sync them at construction). torch 2.13: ``forward_sync_buffers``
    replaces ``broadcast_buffers``, and only the old flag also skips the sync at construction."""
    if forward_sync_buffers is not None:
        return forward_sync_buffers, True
    synced = broadcast_buffers is None or bool(broadcast_buffers)
    return synced, synced


def _device_indices(
    device_ids: Sequence[int | torch.device] | None, output_device: int | torch.device | None
) -> tuple[list[int] | None, int | None]:
    if device_ids is not None and len(device_ids) > 1:
        raise ConfigError(
            f"device_ids={list(device_ids)}: one process per device is supported (torch deprecated "
            "single-process multi-device); start one process per GPU and pass device_ids=[local_rank]."
        )
    ids = [_device_index(d) for d in device_ids] if device_ids else None
    return ids, _device_index(output_device) if output_device is not None else None


def _device_index(device: int | torch.device) -> int:
    if isinstance(device, torch.device):
        if device.index is None:
            raise ConfigError(f"device {device} has no index; pass e.g. torch.device('cuda', local_rank)")
        return device.index
    return int(device)
