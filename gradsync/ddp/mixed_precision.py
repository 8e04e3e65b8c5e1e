"""Mixed precision in the wrapper: low-precision compute over full-precision master weights.

``DistributedDataParallel(..., mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))`` means what torch's
``mixed_precision=_MixedPrecision(...)`` means (torch/nn/parallel/distributed.py), and torch's own dataclass is
accepted as is:

- at each forward, every floating-point parameter (those on the ignore list excepted) is cast to ``param_dtype``
  once, and the module runs on those copies: ``module.parameters()`` inside the forward yields them, as torch's
  ``_root_copy_hook`` makes it; floating-point inputs are cast too (``cast_forward_inputs``, torch always casts);
- the copies are differentiable casts of the full-precision parameters, so backward runs in ``param_dtype`` and
  each gradient reaches its parameter's ``.grad`` as the exact upcast of the low-precision gradient; the reducer's
  buckets hold ``reduce_dtype`` (default ``param_dtype``, torch's default), are summed and then divided by the world
  size in that dtype (torch's ``_reducer_allreduce_and_upcast_hook``), and the averages are written, upcast, into
  the full-precision ``.grad``, so any optimizer steps the master weights;
- outside the forward the module holds its full-precision parameters, so ``state_dict()`` and checkpoints are full
  precision; floating-point buffers are cast to ``buffer_dtype`` once, at construction, and stay so (torch's
  ``_cast_buffers``; torch casts integer buffers too, gradsync only floating-point ones);
- a gradient accumulated across steps (``no_sync``, or ``zero_grad(set_to_none=False)``) is rounded to
  ``param_dtype`` at each forward, as torch casts it down there, so accumulation rounds as torch's does.

Where torch's way and this one differ, it is in memory, not values: torch swaps each parameter's ``.data`` and
registers the reducer's hooks on each step's low-precision accumulator; here the parameters are never swapped, and
the reducer's hooks stay where they are.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from typing import Any

import torch
from torch import nn

from gradsync.ddp.tree import map_tensors
from gradsync.errors import ConfigError
from gradsync.nn.sync_batchnorm import SyncBatchNorm
from gradsync.reducer.backward import ReducePrecision
from gradsync.reducer.local_params import is_dtensor

_FIELDS = ("param_dtype", "reduce_dtype", "buffer_dtype")


@dataclasses.dataclass(frozen=True)
class MixedPrecision:
    """The mixed-precision policy of :class:`gradsync.DistributedDataParallel` (torch's ``_MixedPrecision``, public).

    ``param_dtype``: the dtype the forward and backward compute in (parameters and, with ``cast_forward_inputs``,
    floating-point inputs); None keeps the parameters' own. ``reduce_dtype``: the dtype gradients are averaged in;
    None means ``param_dtype`` (torch's rule). ``buffer_dtype``: the dtype floating-point buffers are kept in; None
    leaves them. Each must be a floating-point dtype. The parameters stay full precision outside the forward and
    backward, and their ``.grad`` is full precision when ``backward()`` returns.

    Example::

        policy = gradsync.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        model = gradsync.DistributedDataParallel(MyModel(), mixed_precision=policy)
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        for field in _FIELDS:
            _check_dtype(field, getattr(self, field))
        if not isinstance(self.cast_forward_inputs, bool):
            raise ConfigError(
                f"MixedPrecision: cast_forward_inputs must be True or False, got {self.cast_forward_inputs!r}"
            )

    @classmethod
    def of(cls, value: object) -> MixedPrecision | None:
        """The policy from DDP's ``mixed_precision=`` argument: None, this class, or torch's ``_MixedPrecision``."""
        if value is None or isinstance(value, MixedPrecision):
            return value
        if dataclasses.is_dataclass(value) and type(value).__name__ == "_MixedPrecision":
            return cls(*(getattr(value, field) for field in _FIELDS))
        raise ConfigError(
            f"mixed_precision must be a gradsync.MixedPrecision (or torch's _MixedPrecision), got "
            f"{type(value).__name__}: pass e.g. gradsync.MixedPrecision(param_dtype=torch.bfloat16)"
        )

    @property
    def reduction(self) -> ReducePrecision:
        """How the reducer averages: in ``reduce_dtype``, else ``param_dtype``, else the gradients' own dtype."""
        return ReducePrecision(self.reduce_dtype or self.param_dtype)


def _check_dtype(field: str, dtype: object) -> None:
    if dtype is None:
        return
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(
            f"MixedPrecision: {field} must be a torch.dtype such as torch.bfloat16, or None, got {dtype!r}"
        )
    if not dtype.is_floating_point:
        raise ConfigError(
            f"MixedPrecision: {field}={dtype} is not a floating-point dtype; only floating-point tensors are cast. "
            "Pass torch.bfloat16, torch.float16 or torch.float32 (or None to leave it)."
        )


def refuse_with_mixed_precision(combination: str, instead: str) -> None:
    """A composition gradsync does not support under mixed precision, refused by name with what to do."""
    raise ConfigError(f"mixed_precision with {combination} is not supported: {instead}")


def check_mixed_precision_composition(module: nn.Module, sparse: Collection[str]) -> None:
    """At construction: refuse what the policy does not compose with, naming the parameter and what to do."""
    if sparse:
        refuse_with_mixed_precision(
            f"sparse gradients (parameter '{sorted(sparse)[0]}', an Embedding with sparse=True)",
            "use sparse=False, or keep the embedding out of DDP (set_params_and_buffers_to_ignore).",
        )
    synced_norms = [name for name, sub in module.named_modules() if isinstance(sub, (SyncBatchNorm, nn.SyncBatchNorm))]
    if synced_norms:
        refuse_with_mixed_precision(
            f"SyncBatchNorm (module '{synced_norms[0]}': its statistics would be all-reduced in param_dtype)",
            "keep BatchNorm local (nn.BatchNorm), or train in full precision with torch.autocast in the model.",
        )
    sharded = [name for name, p in module.named_parameters() if is_dtensor(p)]
    if sharded:
        refuse_with_mixed_precision(
            f"DTensor parameters (tensor parallelism; parameter '{sharded[0]}')",
            "train the tensor-parallel model in full precision under DDP, or use torch.autocast inside it.",
        )


class LowPrecisionCopies:
    """What one model's forward does under a :class:`MixedPrecision` policy: the parameters' low-precision copies
    in the module during its call, the inputs cast, accumulated gradients rounded as torch rounds them."""

    def __init__(self, module: nn.Module, policy: MixedPrecision, ignored: Collection[str]) -> None:
        self.policy = policy
        dtype = policy.param_dtype
        # (owner module, attribute name, parameter) for each parameter the forward computes in param_dtype.
        self._slots: list[tuple[nn.Module, str, nn.Parameter]] = []
        if dtype is None:
            return
        for prefix, owner in module.named_modules(remove_duplicate=False):
            for name, param in owner._parameters.items():
                full = f"{prefix}.{name}" if prefix else name
                if param is not None and full not in ignored and param.is_floating_point() and param.dtype != dtype:
                    self._slots.append((owner, name, param))

    def enter(self, inputs: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any], list]:
        """Before the module's call: returns the inputs to call it with, and what :meth:`leave` restores."""
        dtype = self.policy.param_dtype
        if dtype is None:
            return inputs, kwargs, []
        copies: dict[int, torch.Tensor] = {}  # one copy per parameter, however many modules share it
        swapped = []
        # Only where a backward may follow: an evaluation forward between backward and step keeps .grad as averaged
        # (torch's pre-forward hook would round it there too, and the optimizer would step the rounded gradient).
        round_grads = torch.is_grad_enabled()
        for owner, name, param in self._slots:
            if owner._parameters.get(name) is not param:
                continue  # torch.func.functional_call's tensor in its place: the caller's, left as given
            copy = copies.get(id(param))
            if copy is None:
                if round_grads:
                    _round_accumulated(param, dtype)
                copy = copies[id(param)] = param.to(dtype)
            owner._parameters[name] = copy  # type: ignore[assignment]  # what the forward computes with
            swapped.append((owner, name, param))
        if self.policy.cast_forward_inputs:
            inputs, kwargs = map_tensors(lambda t: _cast(t, dtype), (inputs, kwargs))
        return inputs, kwargs, swapped

    @staticmethod
    def leave(swapped: list) -> None:
        """After the module's call (returned or raised): the full-precision parameters back in the module. The
        copies live on in the autograd graph, for backward, and are freed with it."""
        for owner, name, param in swapped:
            owner._parameters[name] = param


def _round_accumulated(param: nn.Parameter, dtype: torch.dtype) -> None:
    """torch's ``_root_copy_hook`` casts an existing ``.grad`` down to ``param_dtype`` before each forward, so the
    next backward accumulates onto the rounded value. The same rounding, keeping the full-precision tensor."""
    grad = param.grad
    if grad is not None and grad.is_floating_point() and not grad.is_sparse:
        with torch.no_grad():
            grad.copy_(grad.to(dtype))


def _cast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """torch's ``_cast_forward_inputs``: floating-point tensors only."""
    return tensor.to(dtype) if tensor.is_floating_point() and tensor.dtype != dtype else tensor


def cast_buffers(module: nn.Module, policy: MixedPrecision, ignored: Collection[str]) -> None:
    """At construction: floating-point buffers to ``buffer_dtype``, in place of their data (torch's
    ``_cast_buffers``, which keeps the buffer objects)."""
    dtype = policy.buffer_dtype
    if dtype is None:
        return
    for name, buffer in module.named_buffers():
        if name not in ignored and buffer.is_floating_point() and buffer.dtype != dtype:
            buffer.data = buffer.to(dtype)


def mark_parameters_as_torch_does(module: nn.Module, policy: MixedPrecision, ignored: Collection[str]) -> None:
    """torch's DDP gives each parameter ``_mp_param`` (its low-precision copy, storage freed between steps) and
    ``_fp_param`` (its full-precision data); torch's tests and some user code look at their dtypes. gradsync keeps
    no copy there: both are placeholders of the parameter's shape, in ``param_dtype`` and in the parameter's dtype,
    holding no memory (an alias of the data would be copied twice by ``copy.deepcopy`` and pickling)."""
    for name, param in module.named_parameters():
        if name not in ignored:
            param._mp_param = _placeholder(param, policy.param_dtype or param.dtype)  # type: ignore[attr-defined]
            param._fp_param = _placeholder(param, param.dtype)  # type: ignore[attr-defined]


def _placeholder(param: nn.Parameter, dtype: torch.dtype) -> torch.Tensor:
    placeholder = torch.empty_like(param, dtype=dtype, requires_grad=False)
    placeholder.untyped_storage().resize_(0)
    return placeholder


class FullPrecision:
    """No mixed precision: the module is called with its own parameters and the inputs as given."""

    @staticmethod
    def enter(inputs: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any], list]:
        return inputs, kwargs, []

    @staticmethod
    def leave(swapped: list) -> None:
        pass


ForwardPrecision = LowPrecisionCopies | FullPrecision
