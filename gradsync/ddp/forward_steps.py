"""A forward's protocol: what runs eagerly before and after DistributedDataParallel calls the wrapped module.

Before: the step's events (recorder, watchdog, the frozen-parameter check), the Join notification, the forward's
collectives (:class:`~gradsync.ddp.forward_collectives.ForwardCollectives`), the inputs moved to ``device_ids``,
mixed precision's low-precision copies put in the module (:mod:`gradsync.ddp.mixed_precision`), and dynamo's graph
split engaged (:mod:`gradsync.ddp.compiled`). After: the split released, and for a synced forward the
reducer prepared for the backward (:meth:`Reducer.prepare_for_backward`), whose outputs' sink may replace the
outputs. The model calls these from frames dynamo does not trace, so under ``torch.compile(ddp)`` only the module's
call is compiled.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from gradsync.ddp import compiled
from gradsync.ddp.delayed_all_reduce import DelayedAllReduce
from gradsync.ddp.forward_collectives import ForwardCollectives
from gradsync.ddp.join_protocol import JoinProtocol
from gradsync.ddp.mixed_precision import ForwardPrecision, FullPrecision
from gradsync.ddp.tree import iter_tensors, replace_tensors, to_device
from gradsync.errors import ConfigError
from gradsync.observe.recorder import Recorder
from gradsync.reducer.reducer import Reducer
from gradsync.runtime import progress


@dataclasses.dataclass
class ModuleCall:
    """One forward's state between the eager steps around the module's (possibly compiled) call."""

    inputs: tuple
    kwargs: dict[str, Any]
    synced: bool  # a synced forward (grad enabled, not under no_sync): the reducer's steps, and the buffers' rule
    averages: bool = True  # its backward averages (not where functional_call replaced every parameter)
    scale: float = 1.0
    frames_split: int = 0  # GraphSplit.frames_split before the call: more after it means dynamo compiled here
    swapped: list = dataclasses.field(default_factory=list)  # mixed precision's copies in the module (to restore)
    outer_split: object = None
    profiled: Any = dataclasses.field(
        default_factory=lambda: torch.autograd.profiler.record_function("DistributedDataParallel.forward")
    )


class ForwardSteps:
    """The eager steps around each forward's call of the module, built with the model's reducer (again at a
    regroup and when unpickled). ``params`` are the trainable parameters (the first one's device type is where
    ``device_ids`` moves the inputs); ``frozen`` those that did not require grad at construction."""

    def __init__(
        self,
        collectives: ForwardCollectives,
        join: JoinProtocol,
        reducer: Reducer,
        params: Sequence[nn.Parameter],
        frozen: Sequence[tuple[str, nn.Parameter]],
        in_use: Callable[[], bool],
        precision: ForwardPrecision | None = None,
        delayed: DelayedAllReduce | None = None,
    ) -> None:
        self._collectives = collectives
        self._precision = precision or FullPrecision()  # mixed precision's copies and casts, or nothing
        self._join = join
        self._reducer = reducer
        self._params = params
        self._frozen = frozen
        self._recorder = Recorder()
        self._recorder_attached = False
        self._progress = progress.progress_reporter() or _no_progress  # gradsync run --watchdog
        self.graph_split = compiled.GraphSplit(reducer.steady_bucket_cap)
        self._unsplit_checked = False
        self._in_use = in_use
        self._delayed = delayed  # delay_all_reduce_named_params: their buffer set and armed after each forward

    def attach_recorder(self, recorder: Recorder) -> None:
        """Report each synced forward's start and end to ``recorder``."""
        self._recorder, self._recorder_attached = recorder, True

    def detach_recorder(self) -> None:
        self._recorder, self._recorder_attached = Recorder(), False

    def attached_recorder(self) -> Recorder | None:
        return self._recorder if self._recorder_attached else None

    def before(
        self,
        inputs: tuple,
        kwargs: dict[str, Any],
        synced: bool,
        buffers: tuple[bool, bool],  # forward_sync_buffers, and whether the previous forward was a synced one
        device_ids: list[int] | None,
    ) -> ModuleCall:
        """Everything before the module's call; its collectives are the same on every rank."""
        call = ModuleCall(inputs, kwargs, synced)
        call.profiled.__enter__()
        try:
            broadcast = self._collectives.broadcast_due(*buffers)
            if call.synced:
                call.averages = self._begin_synced()
            call.scale = self._join.notify(call.synced, broadcast)
            self._collectives.issue(call.synced, broadcast)
            if device_ids is not None:
                device = torch.device(self._params[0].device.type, device_ids[0])
                call.inputs, call.kwargs = to_device((inputs, kwargs), device)
            call.inputs, call.kwargs, call.swapped = self._precision.enter(call.inputs, call.kwargs)
        except BaseException:
            call.profiled.__exit__(None, None, None)
            raise
        call.frames_split = self.graph_split.frames_split
        call.outer_split = compiled.engage(self.graph_split)
        return call

    def _begin_synced(self) -> bool:
        """A synced step's first eager steps, before its collectives: with or without a call of the module. Returns
        whether its backward averages (:class:`~gradsync.ddp.composition.InUse`, which refuses what construction
        could not see: torch's own pipeline stage calling, parameters replaced after wrapping)."""
        averages = self._in_use()
        self._recorder.forward_start()
        self._progress()
        self._check_still_frozen()
        return averages

    def _check_still_frozen(self) -> None:
        """A parameter frozen at construction has no hook and no bucket: unfrozen later, its gradients would stay
        local and the replicas drift apart silently (torch's DDP does exactly that)."""
        for name, p in self._frozen:
            if p.requires_grad:
                raise ConfigError(
                    f"parameter '{name}' did not require grad when DistributedDataParallel was constructed and "
                    "now does: its gradients would never be averaged. Unfreeze before wrapping (wrap again after "
                    "changing requires_grad), or freeze it again."
                )

    def end_call(self, call: ModuleCall) -> None:
        """The module's call is over (returned or raised): undo what :meth:`before` set up around it."""
        self._precision.leave(call.swapped)
        compiled.release(call.outer_split)
        call.profiled.__exit__(None, None, None)

    def after(self, output: Any, call: ModuleCall) -> Any:
        """After the module returned: a synced forward prepares the reducer's backward; returns the outputs (routed
        through the reducer's sink where this step needs it)."""
        if self.graph_split.frames_split != call.frames_split:
            self._reducer.compiled_in_pieces()
        if call.synced:
            self._recorder.forward_end()
        if self._delayed is not None:
            self._delayed.after_forward(call.synced and call.averages)
        if call.synced and call.averages:
            outputs = list(iter_tensors(output))
            self._warn_if_compiled_unsplit(outputs)
            output = self._arm(output, outputs, call.scale)
        elif torch.is_grad_enabled():
            # no_sync, or functional_call's tensors in place of every parameter: none of DDP's hooks will fire, and
            # torch's reducer, armed, hears none either (a static graph learns at the next step, not from this one).
            self._reducer.skip_next_backward()
        return output

    def sync_without_forward(self, output: Any) -> Any:
        """A synced forward's steps with no call of the module: ``output`` came from forwards run under no_sync, and
        the next backward over it averages what they accumulated (a pipeline stage's last micro-batch). Buffers are
        not broadcast here: the next forward does it, as after any synced step."""
        self._begin_synced()
        self._collectives.issue(True, False)
        self._recorder.forward_end()
        if self._delayed is not None:
            self._delayed.after_forward(True)
        return self._arm(output, list(iter_tensors(output)), 1.0)

    def _arm(self, output: Any, outputs: list[torch.Tensor], scale: float) -> Any:
        """Prepare the reducer's backward over ``outputs`` (``output``'s tensors); ``output``, routed through the
        outputs' sink where this step needs it (find_unused_parameters, static_graph's first iteration)."""
        route = self._reducer.prepare_for_backward(outputs, scale)
        return replace_tensors(output, route) if route is not None else output

    def _warn_if_compiled_unsplit(self, outputs: list[torch.Tensor]) -> None:
        """At the first synced forward: a compiled graph that dynamo did not split cannot overlap (say so, once)."""
        if self._unsplit_checked:
            return
        self._unsplit_checked = True
        if self.graph_split.frames_split == 0 and compiled.made_by_compiled_graph(outputs):
            # The frame it names is DistributedDataParallel.forward's, as when this ran inside the module's class.
            warnings.warn(compiled.unsplit_graph_warning(), RuntimeWarning, stacklevel=5)


def _no_progress() -> None:
    """No watchdog watches this run."""
