"""The outputs' sink: an identity autograd Function whose backward runs first in the outermost backward.

torch's DDP passes outputs through its ``_DDPSink`` for the same two reasons (find_unused_parameters and
static_graph's first iteration); this is gradsync's own:

- outputs the loss does not use then send *undefined* gradients (``set_materialize_grads(False)``), so the
  parameters behind them fire their hooks with no gradient, count as unused, and keep ``.grad`` untouched;
- its backward runs in the outermost backward, not inside a reentrant checkpoint's nested one, so the check queued
  there runs when the whole backward is over.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch


class OutputSink(torch.autograd.Function):
    """``OutputSink.apply(on_backward, *tensors)`` returns the tensors; ``on_backward()`` runs when backward
    reaches them (held weakly: the graph must not keep a reducer alive)."""

    @staticmethod
    def forward(ctx: Any, on_backward: weakref.WeakMethod, *tensors: torch.Tensor) -> Any:  # type: ignore[override]
        ctx.set_materialize_grads(False)  # None gradients stay None instead of becoming zeros
        ctx.on_backward = on_backward
        # Clones, as torch's _DDPSink makes by default: an output returned as-is would be a view of its input, and
        # modifying it in place (a common thing to do with a model's output) would then be an error.
        return tuple(t.clone() for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:  # type: ignore[override]
        callback = ctx.on_backward()
        if callback is not None:
            callback()
        return (None, *grads)


def pass_through_sink(tensors: list[torch.Tensor], on_backward: Callable[[], None]) -> list[torch.Tensor]:
    """``tensors`` with those that have a ``grad_fn`` routed through one :class:`OutputSink` (tensors without one,
    like a parameter returned as-is, are left alone, as torch does: pytorch/pytorch#60733)."""
    chosen = [i for i, t in enumerate(tensors) if t.grad_fn is not None]
    if not chosen:
        return tensors
    routed = OutputSink.apply(weakref.WeakMethod(on_backward), *(tensors[i] for i in chosen))  # type: ignore[arg-type]
    out = list(tensors)
    for i, t in zip(chosen, routed):
        out[i] = t
    return out
