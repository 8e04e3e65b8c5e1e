"""DistributedDataParallel: construction and the public surface around gradsync's own reducer.

A drop-in for ``torch.nn.parallel.DistributedDataParallel``: same class name, argument names and meanings, so a
training script changes one import. The gradient averaging itself lives in :mod:`gradsync.reducer`; every
collective goes through the model's :class:`~gradsync.collectives.Communicator`. What runs around the module's call
at each forward is :mod:`gradsync.ddp.forward_steps`'s, and both sides of ``join()`` are
:mod:`gradsync.ddp.join_protocol`'s: the model builds them with its reducer and calls them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from gradsync import torch_private
from gradsync.collectives.communicator import Communicator
from gradsync.comm import regroup
from gradsync.ddp import compiled
from gradsync.ddp.arguments import (
    Config,
    buffer_sync_flags,
    check_device_types,
    check_hook_signature,
    device_indices,
    group_of,
    refuse_string_switches,
    refuse_unsupported,
    warn_deprecated,
)
from gradsync.ddp.buffers import BufferSync
from gradsync.ddp.composition import InUse, check_composition
from gradsync.ddp.delayed_all_reduce import DelayedAllReduce, delayed_names
from gradsync.ddp.forward_collectives import ForwardCollectives
from gradsync.ddp.forward_steps import ForwardSteps, ModuleCall
from gradsync.ddp.join_protocol import JoinProtocol
from gradsync.ddp.mixed_precision import (
    LowPrecisionCopies,
    MixedPrecision,
    cast_buffers,
    check_mixed_precision_composition,
    mark_parameters_as_torch_does,
    refuse_with_mixed_precision,
)
from gradsync.ddp.replicas import SharedReplica, broadcast_initial_state, verify_same_model
from gradsync.errors import CollectiveError, ConfigError
from gradsync.log import log
from gradsync.observe.recorder import Recorder
from gradsync.reducer.backward import CommHook
from gradsync.reducer.reducer import Reducer
from gradsync.runtime.env import in_elastic_job
from gradsync.validate import require_bool


class DistributedDataParallel(nn.Module, Joinable):
    """Data parallelism: each process holds a replica of ``module``; gradients are averaged during backward.

    Arguments mean what they mean for torch's DDP (2.13's signature, including ``forward_sync_buffers``,
    ``bucket_cap_mb_list``, ``device_mesh`` and ``skip_all_reduce_unused_params``). One difference by design: with
    ``bucket_cap_mb=None`` gradsync starts from torch's caps and, at the bucket rebuild after iteration 1, may
    propose smaller ones from the measured backward timeline and link speed, keeping them only if real steps
    confirm they are faster (:mod:`gradsync.reducer.rebuild`; ``"auto"`` asks for it explicitly,
    ``GRADSYNC_BUCKET_TUNING=0`` or any number turns it off). ``batched_grad_copy`` is accepted and always on:
    small gradients are copied into their bucket with one fused copy. After ``loss.backward()`` returns, every
    parameter's ``.grad`` holds the average over the process group, so ``optimizer.step()`` keeps all replicas
    identical and training equals one process training on all ranks' batches at once.

    ``mixed_precision``: a :class:`gradsync.MixedPrecision` (or torch's ``_MixedPrecision``): the forward and
    backward compute in ``param_dtype`` on copies made once per forward, gradients are averaged in ``reduce_dtype``
    and land, upcast, in the full-precision parameters' ``.grad`` (:mod:`gradsync.ddp.mixed_precision`).

    ``check_for_nan_in_grad=True`` (gradsync's, Megatron's name): before each bucket's collective, one fused check
    that its gradients are finite; a NaN or inf is named (the first parameter holding one, and the rank) before it is
    averaged into every replica. Off by default: each bucket then costs one host sync.

    Two more keyword arguments are gradsync's own, each defaulting to its environment variable: ``bucket_tuning``
    (``GRADSYNC_BUCKET_TUNING``, on: whether ``bucket_cap_mb=None`` may tune) and ``check_desync``
    (``GRADSYNC_DEBUG``, off: compare every collective across ranks before it runs, and name the first that
    differs). Every rank must pass the same values; a difference is refused at construction.

    Example::

        dist.init_process_group("gloo")
        model = gradsync.DistributedDataParallel(MyModel())
        loss = loss_fn(model(x), y)
        loss.backward()          # gradients are averaged across ranks here
        optimizer.step()

    ``state_dict()`` keys carry the ``module.`` prefix, as torch's do; :meth:`module_state_dict` and
    :meth:`load_module_state_dict` read and write the unprefixed state of the wrapped model. A model pickles and
    deep-copies (with the default process group) as torch's does: the copy gets a reducer of its own.
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
        delay_all_reduce_named_params: Any = None,
        param_to_hook_all_reduce: nn.Parameter | None = None,
        device_mesh: Any = None,
        skip_all_reduce_unused_params: bool = False,
        bucket_cap_mb_list: Sequence[float] | None = None,
        batched_grad_copy: bool = False,
        forward_sync_buffers: bool | None = None,
        mixed_precision: MixedPrecision | Any = None,
        bucket_tuning: bool | None = None,
        check_desync: bool | None = None,
        check_for_nan_in_grad: bool = False,
        **unsupported: Any,
    ) -> None:
        super().__init__()
        Joinable.__init__(self)
        refuse_unsupported(unsupported)
        refuse_string_switches(locals())
        warn_deprecated(broadcast_buffers, forward_sync_buffers, check_reduction)
        self.module = module
        self._config = Config.of(
            module,
            (bucket_cap_mb, bucket_cap_mb_list),
            (bucket_tuning, check_desync),
            gradient_as_bucket_view,
            find_unused_parameters,
            static_graph,
            skip_all_reduce_unused_params,
            delayed_names(module, delay_all_reduce_named_params, param_to_hook_all_reduce),
        )
        self._process_group = group_of(process_group, device_mesh)  # None: the default group
        check_composition(module, self._process_group, device_mesh, gradient_as_bucket_view, DistributedDataParallel)
        self.device_mesh = device_mesh
        self.device_ids, self.output_device = device_indices(device_ids, output_device)
        check_device_types(module, {"device_ids": device_ids, "output_device": output_device})
        self.dim = dim
        self.forward_sync_buffers, init_sync_buffers = buffer_sync_flags(broadcast_buffers, forward_sync_buffers)
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        self.batched_grad_copy = batched_grad_copy
        self.require_backward_grad_sync = True
        # torch's name: the previous forward was a synced one, so this forward broadcasts the buffers.
        self.require_forward_param_sync = True
        self.bucket_bytes_cap = self._config.caps.bytes_cap  # torch's attributes
        self.bucket_bytes_cap_list = list(self._config.caps.bytes_cap_list)
        self.bucket_bytes_cap_default = self._config.caps.is_default
        self._hook: tuple[Any, CommHook] | None = None  # (state, hook) as registered: carried across a regroup
        self.mixed_precision = self._mixed_precision_of(mixed_precision)
        self.check_for_nan_in_grad = require_bool(
            "DistributedDataParallel", "check_for_nan_in_grad", check_for_nan_in_grad
        )
        self._build_runtime()
        self._construction_failure = self._sync_replicas(init_sync, init_sync_buffers)

    def _mixed_precision_of(self, argument: object) -> MixedPrecision | None:
        """The policy (:mod:`gradsync.ddp.mixed_precision`), checked against what it cannot compose with; the
        buffers cast and the parameters marked as torch's DDP does, once, at construction."""
        policy = MixedPrecision.of(argument)
        if policy is None:
            return None
        if self._config.delayed:
            refuse_with_mixed_precision(
                "delay_all_reduce_named_params",
                "the delayed parameters are averaged outside the reducer, in their own dtype, so the policy would "
                "not reach them. Use one of the two.",
            )
        check_mixed_precision_composition(self.module, self._config.sparse)
        cast_buffers(self.module, policy, self._config.ignored)
        mark_parameters_as_torch_does(self.module, policy, self._config.ignored)
        return policy

    def _sync_replicas(self, init_sync: bool, buffers: bool) -> CollectiveError | None:
        """The model checked across the ranks, then rank 0's parameters (and ``buffers``) everywhere. In an elastic
        job (``gradsync run --elastic``) a member lost meanwhile is a membership change, not this worker's end: the
        failure is returned, the job's State raises it before training (:meth:`take_construction_failure`) and
        recovers, and the next round's :meth:`rebuild_for_new_group` issues these collectives again: a member lost
        while a worker is admitted costs a round, not the worker's process."""
        try:
            verify_same_model(self._comm, self.module, self._config.ignored, self._collective_settings())
            if init_sync:
                broadcast_initial_state(self._comm, self.module, buffers, self._config.ignored)
        except CollectiveError as exc:
            if self._process_group is not None or not in_elastic_job():
                raise
            log.warning("gradsync elastic: %s; the job's next round recovers", str(exc).splitlines()[0][:200])
            return exc
        return None

    def take_construction_failure(self) -> CollectiveError | None:
        """The failure of the constructor's collectives (the model check, rank 0's state broadcast), kept in an
        elastic job where a member was lost meanwhile; returned once, for ``gradsync.elastic.State`` to recover from
        (it calls this before training). A forward raises it if no State took it. None when they succeeded."""
        failure, self._construction_failure = self._construction_failure, None
        return failure

    def _collective_settings(self) -> dict[str, object]:
        """What decides the collectives each step issues: every rank must agree (checked at construction)."""
        config = self._config
        return {
            "bucket_cap_mb": config.caps.asked,
            "find_unused_parameters": self.find_unused_parameters,
            "static_graph": self.static_graph,
            "forward_sync_buffers": self.forward_sync_buffers,
            "check_desync (GRADSYNC_DEBUG)": config.check_desync,
            "bucket_tuning (GRADSYNC_BUCKET_TUNING)": config.caps.tune,
            "mixed_precision": repr(self.mixed_precision),
        }

    def _build_runtime(self) -> None:
        """What cannot be pickled, built at construction and again when unpickled: the communicator, the reducer
        with its hooks, and the forward's steps and join protocol around them (no collective is issued here)."""
        config = self._config
        named = config.trainable(self.module)
        self._params = [p for _, p in named]
        device = self._params[0].device if self._params else None
        self._comm = Communicator(self._process_group, check_desync=config.check_desync, device=device)
        buffer_sync = BufferSync(self.module, self._comm, config.ignored)
        trainable, outside = {id(p) for p in self._params}, config.ignored | config.delayed
        frozen = [(n, p) for n, p in self.module.named_parameters() if id(p) not in trainable and n not in outside]
        self.reducer = Reducer(
            self._params,
            [n for n, _ in named],
            self._comm,
            config.caps,
            config.as_view,
            config.mode,
            sparse=[n in config.sparse for n, _ in named],
            skip_unused=config.skip_unused,
            precision=None if self.mixed_precision is None else self.mixed_precision.reduction,
            check_finite=self.check_for_nan_in_grad,
        )
        self._comm_hook_registered = False
        self._plan_before_regroup: tuple[list[int], list[int]] | None = None
        collectives = ForwardCollectives(self._comm, buffer_sync, self.reducer)
        self._join_protocol = JoinProtocol(self, self._comm, collectives, self.reducer, self.module, config.ignored)
        in_use = InUse(self.module, named, self._comm.rank, self.find_unused_parameters)
        precision = None
        if self.mixed_precision is not None:
            precision = LowPrecisionCopies(self.module, self.mixed_precision, config.ignored)
        self._delayed = DelayedAllReduce.for_module(self.module, config.delayed, config.delay_hook, self._comm)
        self._forward_steps = ForwardSteps(
            collectives, self._join_protocol, self.reducer, self._params, frozen, in_use, precision, self._delayed
        )

    def rebuild_for_new_group(self) -> None:
        """After the default process group was replaced (gradsync.elastic forms one per membership round): a new
        reducer and communicator for it, the model checked across the new members, and rank 0's parameters and
        buffers everywhere. Issues the same collectives as the constructor, so a newly started member that builds
        its model meets the others doing this. A registered comm hook stays registered (its state's memory of the
        old group dropped: :mod:`gradsync.comm.regroup`), and an attached Monitor keeps recording."""
        if self._process_group is not None:
            raise ConfigError("rebuild_for_new_group works with the default process group (process_group=None)")
        hook, recorder = self._hook, self._forward_steps.attached_recorder()
        plan = self.reducer.bucket_plan()
        self.reducer.close()
        if self._delayed is not None:
            self._delayed.close()
        self._build_runtime()
        self._plan_before_regroup = plan  # what shared_replica() sends if this worker is the new round's rank 0
        verify_same_model(self._comm, self.module, self._config.ignored, self._collective_settings())
        broadcast_initial_state(self._comm, self.module, True, self._config.ignored)
        self._construction_failure = None  # these collectives, which it kept, succeeded on the new group
        if hook is not None:  # its per-rank memory dropped; the shared part arrives with the elastic state
            state, function = hook
            self._hook = (regroup.for_new_group(state, function), function)
            self.reducer.set_comm_hook(*self._hook)
            self._comm_hook_registered = True
        if recorder is not None:  # a Monitor keeps recording across the change
            self.attach_recorder(recorder)

    def shared_replica(self) -> SharedReplica:
        """What every member of a new elastic round must hold alike besides parameters and buffers (the comm hook's
        shared state; the rebuilt buckets, after :meth:`rebuild_for_new_group` the previous reducer's), for
        gradsync.elastic to send rank 0's with the rest of its state (:meth:`load_shared_replica`)."""
        hook = None if self._hook is None else regroup.shared_state(*self._hook)
        return SharedReplica(hook, self.reducer.bucket_plan() or self._plan_before_regroup)

    def load_shared_replica(self, shared: SharedReplica) -> None:
        """Take rank 0's :meth:`shared_replica` before the new round's first forward (every member of the round
        does): the hook's shared state, and the buckets its reducer starts with."""
        if not isinstance(shared, SharedReplica):
            raise ConfigError(
                f"load_shared_replica takes what shared_replica() returned on the round's rank 0 (a SharedReplica), "
                f"not {type(shared).__name__}"
            )
        if self._hook is not None:
            regroup.load_shared_state(*self._hook, shared.hook)
        self.reducer.start_from(shared.layout)

    def __getstate__(self) -> dict[str, Any]:
        if self._process_group is not None:
            raise ConfigError(
                "pickling or copying a DistributedDataParallel works only with the default process group (as in "
                "torch): the copy rebuilds itself on the default group. Wrap with process_group=None."
            )
        state = dict(self.__dict__)
        for name in ("reducer", "_comm", "_params", "_forward_steps", "_join_protocol", "_hook", "_delayed"):
            state.pop(name, None)
        state["_construction_failure"] = None  # the copy rebuilds itself on the default group
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._hook = None  # as torch's copy: the hook lived on the reducer, which is not copied
        self._build_runtime()

    @staticmethod
    def _set_params_and_buffers_to_ignore_for_model(module: nn.Module, params_and_buffers_to_ignore: Any) -> None:
        """torch's name for :meth:`set_params_and_buffers_to_ignore` (FSDP and torchrec call it)."""
        DistributedDataParallel.set_params_and_buffers_to_ignore(module, params_and_buffers_to_ignore)

    @staticmethod
    def set_params_and_buffers_to_ignore(module: nn.Module, names: Any) -> None:
        """Keep the named parameters and buffers (fully qualified, e.g. ``"encoder.weight"``) out of DDP: they are
        neither checked, broadcast nor averaged. Call on the plain module before wrapping it.

        >>> DistributedDataParallel.set_params_and_buffers_to_ignore(model, ["embedding.weight"])  # doctest: +SKIP
        >>> ddp = DistributedDataParallel(model)  # doctest: +SKIP
        """
        # torch's attribute, so torch's wrapper honours the list too (setattr: nn.Module's stubs type attributes).
        setattr(module, torch_private.PARAMS_AND_BUFFERS_TO_IGNORE, list(names))  # noqa: B010

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
    @compiled.frame_outside_compiled_graph
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        # Only the module's call is left for dynamo to compile (torch.compile(ddp)); the rest runs eagerly.
        call = self._before_module(inputs, kwargs)
        try:
            output = self.module(*call.inputs, **call.kwargs)
        except BaseException:
            self._abandon_module_call(call)
            raise
        return self._after_module(output, call)

    @compiled.outside_compiled_graph
    def _before_module(self, inputs: tuple, kwargs: dict[str, Any]) -> ModuleCall:
        if self._construction_failure is not None:  # no elastic State took it: raised as the constructor would have
            raise self._construction_failure
        synced = torch.is_grad_enabled() and self.require_backward_grad_sync
        buffers = (self.forward_sync_buffers, self.require_forward_param_sync)
        return self._forward_steps.before(inputs, kwargs, synced, buffers, self.device_ids)

    @compiled.outside_compiled_graph
    def _abandon_module_call(self, call: ModuleCall) -> None:
        """The module raised: undo what :meth:`_before_module` set up."""
        self._forward_steps.end_call(call)

    @compiled.outside_compiled_graph
    def _after_module(self, output: Any, call: ModuleCall) -> Any:
        self._forward_steps.end_call(call)
        self.require_forward_param_sync = call.synced
        return self._forward_steps.after(output, call)

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

    def sync_next_backward(self, outputs: Any) -> Any:
        """Make the next backward, run over ``outputs``, average every gradient accumulated since the last averaged
        step, as if ``outputs`` came from a synced forward. For schedules that run each forward under
        :meth:`no_sync` and only later know which backward is the last (pipelining: :mod:`gradsync.pipelining`
        calls this before a stage's last backward, where torch's stage calls its DDP's
        ``reducer.prepare_for_backward``). Returns ``outputs`` to run that backward on: the same tensors, or, with
        ``find_unused_parameters`` or in ``static_graph``'s first step, the same values routed through the
        reducer's sink. Every rank of the group calls it at the same point (it may issue collectives).

        >>> with ddp.no_sync():
        ...     out = ddp(x)
        >>> ddp.sync_next_backward(out).sum().backward()   # averages what the no_sync forward accumulated
        """
        if self.mixed_precision is not None:
            refuse_with_mixed_precision(
                "sync_next_backward (gradsync.pipelining's stages)",
                "a pipeline stage's micro-batches would accumulate outside the policy's forward. Train the stage "
                "in full precision, or use torch.autocast inside the stage's module.",
            )
        if not torch.is_grad_enabled():
            raise ConfigError(
                "sync_next_backward: gradients are disabled here (torch.no_grad); call it where the backward will run."
            )
        output = self._forward_steps.sync_without_forward(outputs)
        self.require_forward_param_sync = True  # the next forward broadcasts the buffers, as after a synced one
        return output

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
        by the ranks still training. ``no_sync()`` works inside. With a ``ShardedOptimizer``, use
        ``Join([ddp, optimizer])`` (torch's ``Join``) so the joined ranks shadow its all-gather too.

        >>> with ddp.join():
        ...     for x, y in my_uneven_shard:
        ...         opt.zero_grad(); loss_fn(ddp(x), y).backward(); opt.step()  # doctest: +SKIP
        """
        if self._delayed is not None and enable:
            raise ConfigError(
                "join() with delay_all_reduce_named_params: a joined rank cannot shadow the delayed all-reduce, "
                "which starts inside the others' backward, so they would wait for it. Give every rank the same "
                "number of batches, or leave the parameters to the reducer."
            )
        return self._join_protocol.context(enable, throw_on_early_termination, divide_by_initial_world_size)

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return self._join_protocol.hook(**kwargs)

    @property
    def join_device(self) -> torch.device:
        return self._params[0].device

    @property
    def join_process_group(self) -> dist.ProcessGroup:
        return self.process_group

    def shadow_forward_and_backward(self) -> None:
        """A joined rank, while others still train: the collectives of their forward and, if it synchronises,
        of their backward, with zeros for gradients. The same methods a training rank runs, so the sequences match
        by construction (GRADSYNC_DEBUG fingerprints included)."""
        self._join_protocol.shadow_forward_and_backward()

    def sync_final_model(self, is_last_joiner: bool) -> None:
        """After everyone joined: the last joiner trained longest, so its model becomes everyone's."""
        self._join_protocol.sync_final_model(is_last_joiner)

    # ------------------------------------------------------------------------------------------ extensions
    def register_comm_hook(self, state: object, hook: CommHook) -> None:
        """Replace how each bucket is reduced; same contract as torch's ``register_comm_hook``.

        ``hook(state, bucket) -> torch.futures.Future[torch.Tensor]``; the future's value becomes the bucket's
        averaged gradients. Register once, before the first backward.
        """
        check_hook_signature(hook)
        if self._comm_hook_registered:
            raise ConfigError("register_comm_hook: a communication hook is already registered; register only once.")
        if self.reducer.iteration > 0:
            raise ConfigError("register_comm_hook: register the hook before the first backward pass.")
        self.reducer.set_comm_hook(state, hook)
        self._comm_hook_registered = True
        self._hook = (state, hook)

    def attach_recorder(self, recorder: Recorder) -> None:
        """Report this model's step events to ``recorder`` (what :class:`gradsync.observe.Monitor` does)."""
        self._forward_steps.attach_recorder(recorder)
        self.reducer.attach_recorder(recorder)

    def detach_recorder(self) -> None:
        self._forward_steps.detach_recorder()
        self.reducer.detach_recorder()

    # ---------------------------------------------------------------------------------------------- state
    def module_state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The wrapped model's state dict, without the ``module.`` prefix (what a plain model loads)."""
        return self.module.state_dict(*args, **kwargs)

    def load_module_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> Any:
        """Load an unprefixed state dict (from a plain model or :meth:`module_state_dict`) into the wrapped model."""
        return self.module.load_state_dict(state_dict, strict=strict)
