"""What a ready gradient does, composed from small functions when a backward starts.

The reducer calls one function per ready gradient. Optional behaviour is wrapped around the step's
``mark_ready`` only when it is on (recording the ready order in iteration 1, marking usage, feeding a Monitor,
``create_graph=True``), so the per-gradient path pays for exactly the features in use.
"""

from __future__ import annotations

import sys
import threading
import warnings
from collections.abc import Callable, Sequence

import torch

from gradsync import torch_private

ReadyFunction = Callable[[int], None]


def accumulate_locally(_index: int) -> None:
    """No synced forward was prepared (no_sync), or the reduction is over: autograd's accumulation is all."""


def marking_used(used: bytearray, params: Sequence[torch.Tensor], inner: ReadyFunction) -> ReadyFunction:
    """Count a parameter as used on this rank only if its gradient is defined (torch's rule: an output the loss
    does not use sends an undefined gradient, and such a parameter's ``.grad`` must stay untouched)."""

    def mark(i: int) -> None:
        if params[i].grad is not None:
            used[i] = 1
        inner(i)

    return mark


def recording(record: Callable[[int], None], inner: ReadyFunction) -> ReadyFunction:
    def mark(i: int) -> None:
        record(i)
        inner(i)

    return mark


def polling(poll: Callable[[], None], inner: ReadyFunction) -> ReadyFunction:
    def mark(i: int) -> None:
        poll()
        inner(i)

    return mark


def without_grad(inner: ReadyFunction) -> ReadyFunction:
    """``backward(create_graph=True)`` runs hooks with grad mode on; copying into buckets must not be recorded."""

    def mark(i: int) -> None:
        with torch.no_grad():
            inner(i)

    return mark


def requeue_on_new_graph_task(task: int, queue: Callable[[], None], inner: ReadyFunction) -> ReadyFunction:
    """After a nested (reentrant) backward ended with gradients still to come: at the first gradient of another
    graph task (the outer backward, continuing), queue the end-of-backward check there."""
    pending = [True]

    def mark(i: int) -> None:
        if pending[0] and current_graph_task() != task:
            pending[0] = False
            queue()
        inner(i)

    return mark


def warning_once(message: Callable[[int], str], inner: ReadyFunction) -> ReadyFunction:
    """Warn (once) with ``message(index)``, then go on as ``inner``."""
    warned = [False]

    def mark(i: int) -> None:
        if not warned[0]:
            warned[0] = True
            warnings.warn(message(i), RuntimeWarning, stacklevel=2)
        inner(i)

    return mark


def current_graph_task() -> int:
    """The autograd engine's id for the backward now running (-1 outside one, or where torch cannot say)."""
    return torch_private.current_graph_task_id()


def inside_nested_backward(caller_thread: int) -> bool:
    """Whether the backward now ending runs inside another one (reentrant checkpointing calls backward from a
    Function's backward). Then more gradients of the outer backward may still come.

    Counted by the ``_engine_run_backward`` frames on this thread. The thread that called the outermost backward
    (``caller_thread``, the forward's: torch's CPU engine runs the graph there) holds one frame for it, so a second
    means nested. Any other thread is an autograd device thread (a GPU's): the engine started it, so no frame of
    the outermost backward is on it, and one frame means a reentrant backward runs there. Counting one frame as
    nested everywhere would make every CUDA backward look nested, and a missing gradient would be reported a step
    late.
    """
    depth = 0
    frame = sys._getframe()
    while frame is not None:
        depth += frame.f_code.co_name == torch_private.ENGINE_RUN_BACKWARD_FRAME
        frame = frame.f_back  # type: ignore[assignment]
    outermost_frames = 1 if threading.get_ident() == caller_thread else 0
    return depth > outermost_frames
