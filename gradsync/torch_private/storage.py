"""Who holds a tensor's memory: how many tensors share its storage (``torch._C._storage_Use_Count``), how many
owners its own TensorImpl has (``Tensor._use_count``), and the Python handles on its storage object. The reducer
lends a bucket's memory to ``.grad`` only while it can tell that nothing else holds it
(:class:`gradsync.reducer.buckets.Lending`).

In CPU builds before 2.5 the storage count was registered with CUDA's module only (pytorch/pytorch#131881), so it
may be missing: then nothing is lent, and averages are copied back into ``.grad`` as torch's reducer does.

What each way of sharing a gradient's memory shows here (checked 2.13.0; ``tests/test_lending.py`` keeps it true):

=================================================  ==========================================================
a view, ``.detach()``, ``.data``, ``.numpy()``     another tensor on the storage: the storage's use count
``torch.from_dlpack``, ``np.from_dlpack``,         the capsule holds the gradient's own TensorImpl (an
``torch.utils.dlpack.to_dlpack``                   ``at::Tensor``), not its storage: the tensor's use count
``untyped_storage()`` / ``storage()`` kept         the storage's Python object: its Python references
``__cuda_array_interface__`` (CuPy, Numba)         the consumer keeps the tensor: its Python references
``share_memory_()`` (another process maps it)      the storage is shared (``is_shared``)
pinned memory (a hook returned a pinned gradient)  ``is_pinned``
a raw ``data_ptr()`` kept by an extension, a       nothing: undetectable (docs/migrating.md says how to turn
CUDA graph that captured the address               lending off)
=================================================  ==========================================================

A Python reference to the gradient tensor itself would see the averages (lending points that same tensor at them),
but a consumer of ``__cuda_array_interface__`` (CuPy, Numba) keeps the tensor object and the raw address it read:
so any Python reference beyond the reducer's counts too. A weak reference holds nothing. ``torch.save`` and
``pin_memory()`` copy.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

import torch

_USE_COUNT: Callable[[int], int] | None = getattr(torch._C, "_storage_Use_Count", None)


def storage_holders(tensor: torch.Tensor) -> tuple[int, int]:
    """Who holds ``tensor``'s storage: its use count (each tensor on it, and its Python storage object;
    ``torch._C._storage_Use_Count``, checked 2.13.0), and the Python references to that storage object (a handle
    someone kept from ``untyped_storage()``, which the use count does not show: it is the same object). Call
    :func:`can_count_storage_uses` first."""
    assert _USE_COUNT is not None
    storage = tensor.untyped_storage()
    return _USE_COUNT(storage._cdata), sys.getrefcount(storage)


def can_count_storage_uses() -> bool:
    return _USE_COUNT is not None and hasattr(torch.Tensor, "_use_count")


def _holders(param: torch.Tensor) -> tuple[int, int, int, int]:
    """Who holds ``param``'s gradient and its memory: the Python references to the gradient tensor object (a
    consumer of ``__cuda_array_interface__`` keeps the object and its raw address), the owners of its TensorImpl
    (``Tensor._use_count``: the parameter's ``.grad``, its Python object, a DLPack capsule), the storage's use count,
    and the Python references to its storage object (this function's own included in each)."""
    assert _USE_COUNT is not None
    grad = param.grad
    assert grad is not None
    storage = grad.untyped_storage()
    owners = grad._use_count()  # type: ignore[attr-defined]
    return sys.getrefcount(grad), owners, _USE_COUNT(storage._cdata), sys.getrefcount(storage)


@functools.cache
def _sole_gradient() -> tuple[int, int, int, int]:
    """Calibrated, not assumed: what a gradient that only its parameter holds counts in this torch (one tiny
    backward, once), read the way :func:`gradient_held_by_its_parameter_alone` reads it."""
    with torch.inference_mode(False), torch.enable_grad():
        param = torch.nn.Parameter(torch.zeros(2, device="cpu"))
        (param * 1).sum().backward()
    return _holders(param)


def calibrate() -> None:
    """Measure what a lone gradient counts now, outside any backward (the reducer lends inside one, at its end)."""
    if can_count_storage_uses():
        _sole_gradient()


def gradient_held_by_its_parameter_alone(param: torch.Tensor) -> bool:
    """Whether nothing but ``param`` holds its ``.grad`` and that gradient's memory: no Python reference to the
    gradient object, no other tensor on its storage (a view, a base it was cut from, a NumPy array), no DLPack export
    of it, no Python handle on its storage, and a storage neither shared with other processes nor pinned. The caller
    must hold no reference to the gradient itself. Call :func:`can_count_storage_uses` first."""
    # The tensor's is_pinned (a C call) rather than the storage's (Python): this runs for every lent gradient.
    if param.grad.untyped_storage().is_shared() or param.grad.is_pinned():  # type: ignore[union-attr]
        return False
    return _holders(param) == _sole_gradient()
