"""The autograd engine's private names: which backward is running, a callback at its end, the frame it runs in, a
tensor's version counter, and whether it runs the hooks of a parameter reached only through an undefined gradient
(2.8.0 and later do; gradsync's reducer falls back before)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from gradsync.torch_private.records import needed

_GRAPH_TASK_ID: Callable[[], int] | None = getattr(torch._C, "_current_graph_task_id", None)

ENGINE_RUN_BACKWARD_FRAME = "_engine_run_backward"  # torch.autograd.graph's; checked 2.4.0-2.13.0


def current_graph_task_id() -> int:
    """The autograd engine's id for the backward now running, -1 outside one
    (``torch._C._current_graph_task_id``; checked 2.4.0-2.13.0)."""
    return _GRAPH_TASK_ID() if _GRAPH_TASK_ID is not None else -1


def queue_backward_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the current backward ends, on the engine's thread
    (``Variable._execution_engine.queue_callback``; checked 2.4.0-2.13.0)."""
    engine = getattr(torch.autograd.Variable, "_execution_engine", None)
    if engine is None:
        raise needed("torch.autograd.Variable._execution_engine.queue_callback")
    engine.queue_callback(callback)


def grad_version(tensor: torch.Tensor) -> int:
    """``tensor``'s in-place write counter (``Tensor._version``; checked 2.4.0-2.13.0)."""
    return int(tensor._version)


def probe_hooks_for_undefined_gradients() -> object:
    """Whether the engine runs the post-accumulate-grad hook of a parameter whose only gradient is undefined (an
    output the loss does not use, routed through a sink as gradsync's reducer routes outputs); raises where not."""

    class Sink(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, used: torch.Tensor, unused: torch.Tensor) -> Any:  # type: ignore[override]
            ctx.set_materialize_grads(False)
            return used.clone(), unused.clone()

        @staticmethod
        def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:  # type: ignore[override]
            return grads

    used, unused = torch.zeros(1, requires_grad=True), torch.zeros(1, requires_grad=True)
    ran: list[torch.Tensor] = []
    unused.register_post_accumulate_grad_hook(ran.append)
    with torch.enable_grad():
        out, _ = Sink.apply(used * 1, unused * 1)
        out.sum().backward()
    if not ran:
        raise RuntimeError("the engine skips the hooks of a parameter reached only through an undefined gradient")
    return True


@functools.cache
def hooks_run_for_undefined_gradients() -> bool:
    """Whether this torch runs a parameter's post-accumulate-grad hook when its only gradient is undefined (an
    output the loss does not use): 2.8.0 and later do, 2.4.0 to 2.7.0 do not (one tiny backward, once)."""
    try:
        probe_hooks_for_undefined_gradients()
    except RuntimeError:
        return False
    return True
