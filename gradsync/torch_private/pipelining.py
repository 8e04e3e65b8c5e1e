"""torch.distributed.pipelining's stage, as gradsync's data-parallel stage subclasses it: the class, and a check that
it still has the three methods whose contract gradsync overrides (read in 2.13's ``pipelining/stage.py``):

- ``forward_maybe_with_nosync(*args, **kwargs)``: every micro-batch's forward;
- ``backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)``: each backward, ``"full"``, ``"input"``
  or ``"weight"`` (zero-bubble's split), with ``bwd_kwargs["stage_output"]`` for the first two;
- ``_compute_outputs(*args, module, **kwargs)``: the real forward that infers the stage's output shapes.
"""

from __future__ import annotations

import inspect
import sys
from types import CodeType

from gradsync.errors import GradsyncError

OVERRIDDEN = ("forward_maybe_with_nosync", "backward_maybe_with_nosync", "_compute_outputs")
FORWARDS = ("forward_maybe_with_nosync", "_compute_outputs")  # of those, the two that call the stage's module


def pipeline_stage_type() -> type:
    """``torch.distributed.pipelining.PipelineStage``, once checked to have the methods gradsync overrides; raises
    naming the torch version where it does not (the split backward's ``last_backward`` came with torch 2.6)."""
    import torch
    from torch.distributed.pipelining import PipelineStage

    missing = [name for name in OVERRIDDEN if not callable(getattr(PipelineStage, name, None))]
    if not missing:
        params = inspect.signature(PipelineStage.backward_maybe_with_nosync).parameters
        missing = [f"backward_maybe_with_nosync({name}=...)" for name in ("last_backward",) if name not in params]
    if missing:
        raise GradsyncError(
            f"gradsync.pipelining needs torch's PipelineStage to have {', '.join(missing)}, which torch "
            f"{torch.__version__} lacks: upgrade torch (2.13 is tested), or train without pipeline stages."
        )
    return PipelineStage


def torch_stage_forward_codes() -> frozenset[CodeType]:
    """The code of torch's stage methods that call the stage's module through torch's own path (2.13's
    ``forward_maybe_with_nosync`` and ``_compute_outputs`` as torch wrote them: gradsync's stage overrides both), for
    :mod:`gradsync.ddp.callers` to look for up the stack. Empty, and free, where torch's pipelining was never
    imported."""
    stage_module = sys.modules.get("torch.distributed.pipelining.stage")
    stage_type = getattr(stage_module, "PipelineStage", None)
    if stage_type is None:
        return frozenset()
    return frozenset(
        code for code in (getattr(getattr(stage_type, name, None), "__code__", None) for name in FORWARDS) if code
    )
