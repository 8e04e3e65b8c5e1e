"""torch's ``delay_all_reduce_named_params`` and ``param_to_hook_all_reduce``: some parameters' gradients averaged
in one all-reduce, started when another parameter's gradient is ready, instead of in the reducer's buckets.

torch's meaning (torch/nn/parallel/distributed.py, ``_register_delay_all_reduce_hook``): the named parameters are
left out of the reducer (other DDP arguments do not apply to them); their gradients are views of one flat buffer,
set before each backward; when ``param_to_hook_all_reduce``'s gradient is computed, the buffer is divided by the
world size and all-reduced. Choose a hook parameter whose gradient comes after every delayed one's (an early
layer's: backward runs from the last layer to the first).

Where gradsync differs, it is to keep the result right rather than leave a race or a local gradient:

- The all-reduce starts once the hook parameter's gradient is accumulated, where torch's tensor hook starts it just
  before: when the hook parameter is delayed too (always so when every parameter is), torch's average misses that
  parameter's own gradient, which stays local to each rank.
- torch never waits for that all-reduce: it relies on NCCL's stream order and the reducer waiting for later
  buckets; on gloo, or when every parameter is delayed, ``.grad`` may be read before the average lands. gradsync
  waits for it at the end of the backward.
- A delayed gradient accumulated after the all-reduce started, or a backward in which the hook parameter's gradient
  never came, would leave that gradient local (torch says nothing): gradsync raises at the end of that backward,
  naming the parameters.
- Under ``no_sync()`` the gradients accumulate locally and the next synced backward averages the sum, as for every
  other parameter (torch all-reduces at every backward; the sum is the same).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from gradsync import torch_private
from gradsync.collectives.communicator import Communicator, Op
from gradsync.ddp.arguments import sparse_parameters
from gradsync.errors import ConfigError

_BOTH = (
    "delay_all_reduce_named_params and param_to_hook_all_reduce need to be set at the same time (torch's rule): the "
    "named parameters' gradients are averaged when param_to_hook_all_reduce's gradient is ready."
)


def delayed_names(module: nn.Module, named_params: object, hook_param: object) -> tuple[frozenset[str], str | None]:
    """The delayed parameters' names and the hook parameter's name, checked against ``module``; ``(frozenset(),
    None)`` when nothing is delayed (both None, or an empty list, which torch also treats as nothing delayed)."""
    if (named_params is None) != (hook_param is None):
        raise ValueError(_BOTH)
    if named_params is None:
        return frozenset(), None
    by_id = {id(p): n for n, p in module.named_parameters()}
    names = _checked_pairs(named_params, by_id)
    if not names:
        return frozenset(), None
    if not isinstance(hook_param, nn.Parameter) or id(hook_param) not in by_id or not hook_param.requires_grad:
        raise ConfigError(
            f"param_to_hook_all_reduce must be one of the wrapped module's parameters that requires grad, got "
            f"{_describe(hook_param)}: its gradient's arrival starts the delayed parameters' all-reduce."
        )
    _check_one_buffer(module, names)
    return frozenset(names), by_id[id(hook_param)]


def _checked_pairs(named_params: object, by_id: dict[int, str]) -> list[str]:
    if not isinstance(named_params, Iterable) or isinstance(named_params, (str, bytes, nn.Module)):
        raise ConfigError(
            "delay_all_reduce_named_params must be a list of (name, parameter) pairs, e.g. "
            f"list(model.embedding.named_parameters(prefix='embedding')); got {_describe(named_params)}."
        )
    names: list[str] = []
    for pair in named_params:
        name, param = pair if isinstance(pair, tuple) and len(pair) == 2 else (None, pair)
        if not isinstance(name, str) or by_id.get(id(param)) != name:
            raise ConfigError(
                f"delay_all_reduce_named_params: {_describe(pair)} is not a (name, parameter) pair of the wrapped "
                "module; names are as model.named_parameters() gives them (torch leaves the named parameter out "
                "of the reducer by that name)."
            )
        if name in names:
            raise ConfigError(f"delay_all_reduce_named_params names '{name}' twice; name each parameter once.")
        names.append(name)
    return names


def _check_one_buffer(module: nn.Module, names: Sequence[str]) -> None:
    """The delayed gradients live in one flat buffer: one dtype, one device, dense (as torch's)."""
    params = dict(module.named_parameters())
    first = params[names[0]]
    for name in names:
        p = params[name]
        if (p.dtype, p.device) != (first.dtype, first.device):
            raise ConfigError(
                f"delay_all_reduce_named_params: '{names[0]}' is {first.dtype} on {first.device} and '{name}' is "
                f"{p.dtype} on {p.device}; the delayed gradients share one buffer, so delay parameters of one dtype "
                "and device (or leave the others to the reducer)."
            )
        if not p.dtype.is_floating_point:
            raise ConfigError(
                f"delay_all_reduce_named_params: '{name}' is {p.dtype}; only floating-point parameters have "
                "gradients to average."
            )
    clash = sorted(sparse_parameters(module).intersection(names))
    if clash:
        raise ConfigError(
            f"delay_all_reduce_named_params: '{clash[0]}' has sparse gradients (sparse=True), which cannot be views "
            "of the delayed parameters' dense buffer; leave it to the reducer."
        )


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    if isinstance(value, tuple):
        return f"({', '.join(_describe(v) if isinstance(v, torch.Tensor) else repr(v)[:60] for v in value)})"
    return f"{type(value).__name__} {value!r}"[:120]


class DelayedAllReduce:
    """The delayed parameters' buffer and hooks for one model on one communicator (built again at a regroup).

    ``params``: the delayed parameters, in the order their gradients sit in the buffer; ``names``: theirs;
    ``hook_param``: the parameter whose gradient's arrival starts the all-reduce.
    """

    def __init__(
        self, params: Sequence[nn.Parameter], names: Sequence[str], hook_param: nn.Parameter, comm: Communicator
    ) -> None:
        self._params = list(params)
        self._comm = comm
        first = self._params[0]
        self.buffer = torch.zeros(sum(p.numel() for p in self._params), dtype=first.dtype, device=first.device)
        self._views = [v.view_as(p) for v, p in zip(self.buffer.split([p.numel() for p in params]), params)]
        self._armed = False  # the next backward averages (a synced forward ran)
        self._future: Any = None  # the all-reduce in flight, from the hook parameter's gradient to backward's end
        self._late: list[str] = []  # delayed gradients accumulated after the all-reduce started
        self._arrived = False  # a delayed gradient accumulated in this armed backward
        self._callback_queued = False
        self._handles = [p.register_post_accumulate_grad_hook(self._make_noter(n)) for p, n in zip(params, names)]
        # After the notes: when the hook parameter is delayed too, its own gradient is in the buffer first.
        self._handles.append(hook_param.register_post_accumulate_grad_hook(self._start))

    @classmethod
    def for_module(
        cls, module: nn.Module, names: frozenset[str], hook_name: str | None, comm: Communicator
    ) -> DelayedAllReduce | None:
        """The buffer and hooks for ``module``'s delayed parameters (:func:`delayed_names`), None if none."""
        if not names or hook_name is None:
            return None
        named = [(n, p) for n, p in module.named_parameters() if n in names]
        hook_param = dict(module.named_parameters())[hook_name]
        return cls([p for _, p in named], [n for n, _ in named], hook_param, comm)

    def close(self) -> None:
        """Remove the hooks: this model's runtime is being rebuilt (a new group, an unpickled copy)."""
        for handle in self._handles:
            handle.remove()

    def after_forward(self, synced: bool) -> None:
        """After each forward (torch's ``_clear_grad_buffer``): every delayed parameter without a gradient gets its
        view of the buffer, so the backward accumulates into it; a synced forward arms the next backward."""
        missing = [p.grad is None for p in self._params]
        every = all(missing)
        if every:
            self.buffer.zero_()  # one fill for the whole buffer, as torch batches it
        for param, view, none in zip(self._params, self._views, missing):
            if none:
                if not every:
                    view.zero_()
                param.grad = view
        self._armed = synced

    def _start(self, param: torch.Tensor) -> None:
        """The hook parameter's gradient is accumulated: average the buffer (torch divides first, then sums)."""
        if not self._armed or self._future is not None:
            return
        self._queue_end_of_backward()
        self.buffer.div_(self._comm.size)
        self._future = self._comm.all_reduce_async(Op.DELAYED_ALLREDUCE, self.buffer)

    def _make_noter(self, name: str) -> Any:
        def note(param: torch.Tensor) -> None:
            if not self._armed:
                return
            self._arrived = True
            self._queue_end_of_backward()
            if self._future is not None:
                self._late.append(name)

        return note

    def _queue_end_of_backward(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch_private.queue_backward_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        future, late, arrived = self._future, self._late, self._arrived
        self._future, self._late, self._arrived = None, [], False
        self._armed = self._callback_queued = False
        if future is not None:
            self._comm.wait(future, Op.DELAYED_ALLREDUCE)
        if late:
            raise ConfigError(
                f"delayed parameter(s) {', '.join(repr(n) for n in late)} got their gradient after "
                "param_to_hook_all_reduce's, when the delayed all-reduce had already started: it stays local to "
                "this rank. Choose a param_to_hook_all_reduce whose gradient comes later in the backward (an "
                "earlier layer's), or delay fewer parameters."
            )
        if future is None and arrived:
            raise ConfigError(
                "this backward computed delayed parameters' gradients but not param_to_hook_all_reduce's, so they "
                "were never averaged: the hook parameter must take part in every synced backward (choose one the "
                "loss always depends on)."
            )
