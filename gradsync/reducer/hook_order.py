"""One bucket's communication hook at a time, where a hook's later collectives would otherwise interleave.

A process group matches collectives by the order each rank issues them. torch's PowerSGD hook issues a bucket's
first all-reduce from the caller and its next ones from the callbacks of the one before (``fut.then(...)``). On
NCCL a collective's future completes as it is queued, so those callbacks run at once on the issuing thread and
the order is the same everywhere. On gloo a future completes on one of the backend's worker threads: bucket 0's
second all-reduce, issued from there, races with bucket 1's first, issued by autograd, and ranks that pick
different winners pair different collectives and hang (torch's DDP hangs there as well).

:class:`OneAtATime` starts each bucket's hook only once the previous bucket's future has completed, so every
collective of bucket k is issued before any of bucket k + 1, on every rank. :func:`hook_needs_order` says which
hooks need that: PowerSGD's, and a user's marked with :func:`issues_from_callbacks`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

from gradsync.validate import require_callable

Start = Callable[[], torch.futures.Future]

# The hooks known to issue collectives from their callbacks: torch's PowerSGD pair (found through wrappers and
# closures too, as fp16_compress_wrapper(powerSGD_hook) or a user's function that calls it). Any other hook keeps
# torch's behaviour, every bucket started at once: a hook may complete a bucket's future only when a later bucket
# is started (gradsync's quantized hook does), which one at a time would deadlock.
_CHAINING = frozenset({powerSGD_hook.powerSGD_hook, powerSGD_hook.batched_powerSGD_hook})
_MARK = "_gradsync_issues_from_callbacks"
_SEARCH_DEPTH = 4  # wrappers of wrappers; a closure's functions are looked through this many times at most


def issues_from_callbacks(hook: Callable[[Any, Any], torch.futures.Future]) -> Callable[[Any, Any], Any]:
    """Mark a communication hook that issues collectives from its futures' callbacks, as PowerSGD does: on gloo,
    where those callbacks run on the backend's threads, its buckets then run one at a time, in bucket order, and
    its collectives cannot interleave with the next bucket's (torch's DDP hangs there).

    Example::

        ddp.register_comm_hook(None, gradsync.comm.issues_from_callbacks(my_two_stage_hook))
    """
    # Refused when marked: functools.wraps takes anything, and the mistake would show only at the first bucket.
    require_callable("issues_from_callbacks", "hook", hook)

    @functools.wraps(hook)
    def marked(state: Any, bucket: Any) -> torch.futures.Future:
        return hook(state, bucket)

    setattr(marked, _MARK, True)
    return marked


def hook_needs_order(hook: Callable[..., Any], completes_on_issuing_thread: bool) -> bool:
    """Whether ``hook``'s buckets must be started one at a time: on a backend whose futures complete on other
    threads (gloo), for PowerSGD and hooks marked with :func:`issues_from_callbacks`."""
    return not completes_on_issuing_thread and _reaches_chaining(hook, _SEARCH_DEPTH)


def _reaches_chaining(function: Any, depth: int) -> bool:
    function = getattr(function, "__func__", function)  # a bound method: its function
    if function in _CHAINING or getattr(function, _MARK, False):
        return True
    if depth == 0:
        return False
    inner = [getattr(function, "func", None), getattr(function, "__wrapped__", None)]  # partial, functools.wraps
    inner += _closure_contents(function)
    return any(callable(f) and _reaches_chaining(f, depth - 1) for f in inner)


def _closure_contents(function: Any) -> list[Any]:
    contents = []
    for cell in getattr(function, "__closure__", None) or ():
        try:
            contents.append(cell.cell_contents)
        except ValueError:  # a cell not yet filled
            continue
    return contents


class OneAtATime:
    """Start each hook when the previous one's future has completed; until then hand back a future that takes
    the hook's result when it comes.

    Example::

        order = OneAtATime()
        first = order.start(lambda: hook(state, bucket0))
        second = order.start(lambda: hook(state, bucket1))  # starts when ``first`` completes
    """

    def __init__(self) -> None:
        self._last: torch.futures.Future | None = None

    def start(self, begin: Start, placeholder: Callable[[], torch.futures.Future]) -> torch.futures.Future:
        """``begin()`` now if nothing is running, else later; ``placeholder()`` makes the future handed back
        meanwhile (one with the bucket's devices, so a CUDA result carries its stream's event)."""
        last = self._last
        if last is None or last.done():
            future = begin()
        else:
            future = placeholder()
            # add_done_callback runs the callback at once if ``last`` completed meanwhile: no race to lock.
            last.add_done_callback(lambda previous: _begin_after(previous, begin, future))
        self._last = future
        return future


def _begin_after(previous: torch.futures.Future, begin: Start, future: torch.futures.Future) -> None:
    try:
        previous.value()
    except Exception as exc:  # the reducer's wait names the previous bucket's failure first
        future.set_exception(RuntimeError(f"not started: the previous bucket's hook failed ({exc})"))
        return
    try:
        started = begin()
    except Exception as exc:
        future.set_exception(exc)
        return
    started.add_done_callback(lambda done: _pass_on(done, future))


def _pass_on(done: torch.futures.Future, future: torch.futures.Future) -> None:
    try:
        value = done.value()
    except Exception as exc:
        future.set_exception(exc)
        return
    future.set_result(value)
