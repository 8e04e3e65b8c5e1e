"""A pipeline stage whose module is gradsync's DistributedDataParallel: torch's ``PipelineStage`` with the
data-parallel steps torch's stage takes only for torch's own DDP class (``torch/distributed/pipelining/stage.py``
tests ``isinstance(submod, torch.nn.parallel.DistributedDataParallel)``; a gradsync model takes its plain-module path
and every micro-batch's backward would average, the first one alone before the others accumulate on top).

What torch's stage does for its DDP, done here through gradsync's public methods:

- every micro-batch's forward runs under ``no_sync()``, so gradients accumulate locally;
- the stage's last backward (``last_backward``, chosen by the schedule) is the synchronised one: the model is told
  so just before it (:meth:`~gradsync.DistributedDataParallel.sync_next_backward`), and each bucket's all-reduce
  overlaps the rest of that backward, as in torch;
- torch's ``scale_grads`` then divides the averages by the number of micro-batches, as for torch's DDP.

Zero-bubble schedules split the backward in two: ``"input"`` (``autograd.grad`` to the stage's inputs) and
``"weight"`` (``autograd.grad`` to the parameters, summed into ``.grad`` by hand). Neither runs a parameter's
``AccumulateGrad``, so no gradient hook fires (torch's DDP averages nothing there either). After the last ``"weight"``
pass, each parameter with a gradient is given a zero gradient through autograd, which runs its hook: the buckets
are averaged then, whole, without overlap, and the result is the same.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

import torch

from gradsync.ddp.module import DistributedDataParallel
from gradsync.pipelining.arguments import check_stage, check_stage_callables
from gradsync.torch_private.pipelining import pipeline_stage_type

_TorchPipelineStage: Any = pipeline_stage_type()


class PipelineStage(_TorchPipelineStage):  # type: ignore[misc]
    """torch's ``PipelineStage``, for a ``submodule`` wrapped in gradsync's DistributedDataParallel over its
    data-parallel group; the same arguments. Any other ``submodule`` behaves exactly as under torch's stage.

    Example (one stage of two, data-parallel over ``mesh["dp"]``)::

        from torch.distributed.pipelining import ScheduleGPipe
        from gradsync.pipelining import PipelineStage

        ddp = gradsync.DistributedDataParallel(stage_module, device_mesh=mesh["dp"])
        stage = PipelineStage(ddp, stage_index, 2, device, group=mesh["pp"].get_group())
        schedule = ScheduleGPipe(stage, n_microbatches=4, loss_fn=loss_fn)
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Checked before torch's stage takes them: a wrong stage_index or num_stages otherwise ends in a bare
        # AssertionError, a deadlock or a gloo abort at the first step (gradsync/pipelining/arguments.py).
        bound = inspect.signature(_TorchPipelineStage.__init__).bind(self, *args, **kwargs).arguments
        check_stage(bound.get("submodule"), bound.get("stage_index"), bound.get("num_stages"), bound.get("group"))
        check_stage_callables(bound.get("device"), bound.get("dw_builder"), bound.get("get_mesh"))
        super().__init__(*args, **kwargs)

    # torch's parameters, as help(), editors and the generated sweep (conformance/sweep/generated/) read them: a bare
    # (*args, **kwargs) hid every one, and the sweep's 19 PipelineStage cases with them.
    __init__.__signature__ = inspect.signature(_TorchPipelineStage.__init__)  # type: ignore[attr-defined]

    def _data_parallel(self) -> DistributedDataParallel | None:
        return self.submod if isinstance(self.submod, DistributedDataParallel) else None

    @contextlib.contextmanager
    def _accumulating(self) -> Iterator[None]:
        ddp = self._data_parallel()
        with ddp.no_sync() if ddp is not None else contextlib.nullcontext():
            yield

    def forward_maybe_with_nosync(self, *args: Any, **kwargs: Any) -> Any:
        with self._accumulating():
            return self.submod(*args, **kwargs)

    def _compute_outputs(self, *args: Any, module: torch.nn.Module, **kwargs: Any) -> Any:
        # The forward that infers the output shapes: a training forward of the model, accumulating nothing.
        with self._accumulating():
            return module(*args, **kwargs)

    def backward_maybe_with_nosync(
        self, backward_type: str, bwd_kwargs: dict, last_backward: bool = False
    ) -> tuple[tuple[torch.Tensor | None, ...], list[dict[str, Any]] | None]:
        ddp = self._data_parallel()
        if ddp is None or not last_backward or backward_type == "input":
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=last_backward)
        if backward_type == "full":
            # Routed through the reducer's sink where find_unused_parameters or static_graph needs it.
            bwd_kwargs = {**bwd_kwargs, "stage_output": ddp.sync_next_backward(bwd_kwargs["stage_output"])}
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=last_backward)
        result = super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=last_backward)
        _average_accumulated(ddp)
        return result


def _average_accumulated(ddp: DistributedDataParallel) -> None:
    """After zero-bubble's last weight pass, which fires no hook: a zero gradient for every parameter that has one,
    through autograd, runs each one's hook and so the model's all-reduce; a parameter no micro-batch used keeps
    ``grad=None``, as find_unused_parameters expects."""
    accumulated = [p for p in ddp.parameters() if p.requires_grad and p.grad is not None]
    views = ddp.sync_next_backward([p.view_as(p) for p in accumulated])  # a grad_fn each: the sink can see them
    torch.autograd.backward(views, grad_tensors=[torch.zeros_like(p) for p in accumulated])
