"""The CUDA-to-CPU mapping applied inside every process of a torch-suite run (see the package docstring).

Three pieces, installed by :func:`install` at import time of :mod:`conformance.torch_suite.harness`:

- *scoped fakes* for ``torch.cuda.is_available / device_count / current_device / set_device / synchronize /
  manual_seed(_all)``: they answer as a machine with ``WORLD_SIZE`` GPUs only when called from torch's test code
  (``common_distributed`` and ``distributed_test``: the skip decorators and the test bodies); torch's own modules
  and gradsync still see the real CPU-only machine;
- :class:`CpuDeviceMode`, a ``TorchFunctionMode`` entered around each test method in the rank processes, which
  maps ``device=<int | cuda>``, ``Tensor.to(<int | cuda>)`` and ``Tensor.cuda()`` to the CPU;
- :func:`map_ddp_class`: the DDP class a run uses (torch's or gradsync's), with one thin change made identically to
  both: ``device_ids`` / ``output_device`` are dropped when the wrapped module lives on the CPU (torch's DDP refuses
  them for CPU modules, and the tests pass ``device_ids=[rank]`` because upstream their module is on ``cuda:rank``).
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

DDP_ENV = "GRADSYNC_TORCH_SUITE_DDP"
DDP_KINDS = ("torch", "gradsync")

# Modules whose calls to torch.cuda.* see the fake GPUs: torch's distributed test code, nothing else.
TEST_CODE_MODULES = frozenset(
    {
        "torch.testing._internal.common_distributed",
        "torch.testing._internal.distributed.distributed_test",
    }
)

_current_device = [0]


def fake_gpu_count() -> int:
    """One fake GPU per rank: the machine upstream CI runs these tests on with ``WORLD_SIZE`` ranks."""
    return int(os.environ.get("WORLD_SIZE", "2"))


def _called_from_test_code(depth: int = 2) -> bool:
    return sys._getframe(depth).f_globals.get("__name__", "") in TEST_CODE_MODULES


def _scoped(real: Callable[..., Any], fake: Callable[..., Any]) -> Callable[..., Any]:
    """``fake`` for calls made from torch's test code, ``real`` for everyone else."""

    @functools.wraps(real)
    def dispatch(*args: Any, **kwargs: Any) -> Any:
        if _called_from_test_code():
            return fake(*args, **kwargs)
        return real(*args, **kwargs)

    return dispatch


def _set_device(device: Any) -> None:
    index = device.index if isinstance(device, torch.device) else device
    _current_device[0] = int(index) if isinstance(index, int) else 0


def _no_op(*_args: Any, **_kwargs: Any) -> None:
    return None


def install_cuda_fakes() -> None:
    """Replace the torch.cuda functions the tests call with scoped fakes (idempotent)."""
    cuda = torch.cuda
    if getattr(cuda.is_available, "_torch_suite_fake", False):
        return
    fakes: dict[str, Callable[..., Any]] = {
        "is_available": lambda: True,
        "device_count": fake_gpu_count,
        "current_device": lambda: _current_device[0],
        "set_device": _set_device,
        "synchronize": _no_op,
        "manual_seed": _no_op,
        "manual_seed_all": _no_op,
    }
    for name, fake in fakes.items():
        scoped = _scoped(getattr(cuda, name), fake)
        scoped._torch_suite_fake = True  # type: ignore[attr-defined]
        setattr(cuda, name, scoped)


def patch_test_constants() -> None:
    """After distributed_test is imported: let ``skip_if_no_gpu`` (which reads ``TEST_CUDA``) run the tests.

    Done after the import on purpose: ``requires_nccl_version`` reads ``TEST_CUDA`` at decoration time and must
    keep seeing False (it would ask NCCL for its version).
    """
    from torch.testing._internal import common_distributed

    common_distributed.TEST_CUDA = True


def _is_accelerator(device: Any) -> bool:
    """An ``int`` device index, or a cuda device (``"cuda"``, ``"cuda:1"``, ``torch.device("cuda", 1)``)."""
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    return isinstance(device, torch.device) and device.type == "cuda"


# Functions taking a device as a positional argument -> its position. Module.to goes through _parse_to.
_DEVICE_POSITION = {torch.Tensor.to: 1, torch._C._nn._parse_to: 0}
_CUDA_FUNCS = frozenset({torch.Tensor.cuda})


class CpuDeviceMode(TorchFunctionMode):
    """Runs what the test code asks of a GPU on the CPU: the tensors stay where they are."""

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if func in _CUDA_FUNCS:
            return args[0]  # Tensor.cuda(): already "on the device"
        if _is_accelerator(kwargs.get("device")):
            kwargs["device"] = "cpu"
        position = _DEVICE_POSITION.get(func)
        if position is not None and len(args) > position and _is_accelerator(args[position]):
            args = (*args[:position], "cpu", *args[position + 1 :])
        return func(*args, **kwargs)


def _on_cpu(module: Any) -> bool:
    if not isinstance(module, nn.Module):
        return False
    tensors = [*module.parameters(), *module.buffers()]
    return all(t.device.type == "cpu" for t in tensors)


def strip_device_ids_for_cpu_modules(cls: type) -> type:
    """Wrap ``cls.__init__`` so that ``device_ids`` / ``output_device`` are dropped for CPU modules (idempotent)."""
    original = cls.__init__
    if getattr(original, "_torch_suite_cpu_mapped", False):
        return cls
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        try:
            bound = signature.bind(self, *args, **kwargs)
        except TypeError:
            original(self, *args, **kwargs)  # let the class raise its own error for a bad call
            return
        if _on_cpu(bound.arguments.get("module")):
            for name in ("device_ids", "output_device"):
                if name in bound.arguments:
                    bound.arguments[name] = None
        original(*bound.args, **bound.kwargs)

    __init__._torch_suite_cpu_mapped = True  # type: ignore[attr-defined]
    cls.__init__ = __init__  # type: ignore[misc]
    return cls


def ddp_kind() -> str:
    kind = os.environ.get(DDP_ENV, "torch")
    if kind not in DDP_KINDS:
        raise ValueError(f"{DDP_ENV}={kind!r}: expected one of {DDP_KINDS}")
    return kind


def map_ddp_class(kind: str) -> type:
    """Install the DDP class of ``kind`` under torch's public names; returns it."""
    import torch._dynamo.convert_frame  # noqa: F401
    import torch.nn.parallel
    import torch.nn.parallel.distributed

    # torch._dynamo binds `DistributedDataParallel` when imported (and calls the torch-private
    # `_get_active_ddp_module()` on it). It is imported before the swap so that it keeps torch's class, as it does in
    # a real program, where only user code names gradsync's; otherwise the outcome would hang on import order.
    if kind == "gradsync":
        import gradsync

        cls: type = gradsync.DistributedDataParallel
    else:
        cls = torch.nn.parallel.distributed.DistributedDataParallel
    strip_device_ids_for_cpu_modules(cls)
    torch.nn.parallel.DistributedDataParallel = cls  # type: ignore[misc]
    torch.nn.parallel.distributed.DistributedDataParallel = cls  # type: ignore[misc]
    return cls


def install() -> type:
    """Everything that must happen before distributed_test is imported. Returns the DDP class in use."""
    install_cuda_fakes()
    return map_ddp_class(ddp_kind())
