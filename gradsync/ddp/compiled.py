"""Overlap under ``torch.compile``: the one place gradsync touches torch-private names.

Why it is needed: AOTAutograd turns a compiled graph's backward into a single autograd node, so every parameter's
gradient, and so every gradsync hook, arrives when that node ends: no bucket could start before backward is over.
torch's DDP gets its overlap back from dynamo's DDPOptimizer (``torch/_dynamo/backends/distributed.py``), which
splits the compiled graph where the buckets end, so each bucket's backward is an autograd node of its own and its
gradients are ready when that node ends.

How it is engaged: whenever dynamo converts a frame while
``torch.nn.parallel.DistributedDataParallel._get_active_ddp_module()`` returns something, it compiles the frame
through DDPOptimizer, reading nothing from that object but its ``bucket_bytes_cap`` (``torch/_dynamo/
convert_frame.py``). torch's DDP sets the class attribute ``_active_ddp_module`` to itself around the call of its
module (``_inside_ddp_forward``). gradsync sets it, around the same call, to a :class:`GraphSplit` that answers
``bucket_bytes_cap`` with the reducer's cap and counts how many frames were split. gradsync never calls torch's DDP:
its class is only the place where dynamo looks.

The split follows torch's bucket rule in graph order: a first piece of 1 MiB (``dist._DEFAULT_FIRST_BUCKET_BYTES``,
as gradsync's first bucket), then pieces of the cap, each extended until it has an output. gradsync's buckets follow
the same rule over the parameters, and after the rebuild over the order their gradients became ready, which under
compile is piece by piece; so a bucket launches when the piece that holds its last gradient is done.

Everything private is named in :data:`PRIVATE_NAMES` and checked when this module is imported: if torch has changed
it, gradsync warns once and trains as in eager mode (all buckets reduced after a compiled backward).
"""

from __future__ import annotations

import importlib.util
import inspect
import warnings
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch
import torch._dynamo  # what torch.compiler.disable needs; any torch optimizer imports it too
from torch.nn.parallel import DistributedDataParallel as _TorchDDP

from gradsync.reducer.buckets import DEFAULT_FIRST_BUCKET_BYTES

F = TypeVar("F", bound=Callable[..., Any])

PRIVATE_NAMES = (
    "torch.nn.parallel.DistributedDataParallel._active_ddp_module",
    "torch.nn.parallel.DistributedDataParallel._get_active_ddp_module",
    "torch._dynamo.utils.get_optimize_ddp_mode",
    "torch._dynamo.backends.distributed.DDPOptimizer",
    "torch._dynamo.convert_frame: DDPOptimizer(bucket_bytes_cap=<active module>.bucket_bytes_cap, ...)",
    "CompiledFunctionBackward: the name of AOTAutograd's backward node (to notice a graph that was not split)",
)


def missing_seam() -> str | None:
    """What of :data:`PRIVATE_NAMES` the installed torch lacks, or None when the seam is all there."""
    if not hasattr(_TorchDDP, "_active_ddp_module") or not callable(getattr(_TorchDDP, "_get_active_ddp_module", None)):
        return "torch.nn.parallel.DistributedDataParallel._active_ddp_module / _get_active_ddp_module"
    if not callable(getattr(torch._dynamo.utils, "get_optimize_ddp_mode", None)):
        return "torch._dynamo.utils.get_optimize_ddp_mode"
    if importlib.util.find_spec("torch._dynamo.backends.distributed") is None:
        return "torch._dynamo.backends.distributed (DDPOptimizer)"
    try:
        source = inspect.getsource(torch._dynamo.convert_frame)
    except (OSError, TypeError):
        return "the source of torch._dynamo.convert_frame (to check how it engages DDPOptimizer)"
    if "_get_active_ddp_module()" not in source or ".bucket_bytes_cap" not in source:
        return "torch._dynamo.convert_frame's use of _get_active_ddp_module().bucket_bytes_cap"
    return None


_MISSING = missing_seam()
if _MISSING is not None:
    warnings.warn(
        f"gradsync: this torch ({torch.__version__}) lacks {_MISSING}, through which dynamo splits a compiled graph "
        "at bucket boundaries. Compiled models still train correctly, but every bucket is reduced after the "
        "compiled backward, with no overlap. Eager models are unaffected.",
        RuntimeWarning,
        stacklevel=2,
    )


def outside_compiled_graph(fn: F) -> F:
    """Run ``fn`` eagerly, and everything it calls: dynamo never traces it (gradsync's bookkeeping and collectives
    stay Python, under ``torch.compile(ddp)`` too)."""
    return torch.compiler.disable(fn)  # type: ignore[return-value]


def frame_outside_compiled_graph(fn: F) -> F:
    """Run ``fn``'s own frame eagerly but let dynamo compile what it calls (torch's ``_inside_ddp_forward`` is marked
    the same way): DDP's forward, whose one call of the wrapped module is what ``torch.compile(ddp)`` compiles."""
    return torch.compiler.disable(fn, recursive=False)  # type: ignore[return-value]


class GraphSplit:
    """What dynamo reads while it compiles a frame inside gradsync's forward: the cap to split the graph at.

    ``cap()`` gives the reducer's current steady bucket cap in bytes; it is raised to the first piece's 1 MiB,
    which DDPOptimizer requires (a smaller cap would fail the compile). ``frames_split`` counts the frames dynamo
    compiled through DDPOptimizer for this model (each reads the cap once, at compile time, never per step).
    """

    def __init__(self, cap: Callable[[], int]) -> None:
        self._cap = cap
        self.frames_split = 0

    @property
    def bucket_bytes_cap(self) -> int:
        self.frames_split += 1
        return max(self._cap(), DEFAULT_FIRST_BUCKET_BYTES)


def engage(split: GraphSplit) -> object:
    """From now on, a frame dynamo compiles is split at ``split``'s cap; returns what :func:`release` restores (an
    outer DDP's split, when DDPs nest). Two calls rather than a context manager, each made from a frame dynamo does
    not trace (a generator frame inside DDP's forward would be traced under ``torch.compile(ddp)``)."""
    if _MISSING is not None:
        return None
    previous = _TorchDDP._active_ddp_module
    _TorchDDP._active_ddp_module = split  # type: ignore[assignment]
    return previous


def release(previous: object) -> None:
    """Undo :func:`engage`."""
    if _MISSING is None:
        _TorchDDP._active_ddp_module = previous  # type: ignore[assignment]


def made_by_compiled_graph(tensors: Iterable[torch.Tensor]) -> bool:
    """Whether any of ``tensors`` is the output of an AOTAutograd-compiled graph (its backward is one node)."""
    return any(type(t.grad_fn).__name__ == "CompiledFunctionBackward" for t in tensors if t.grad_fn is not None)


def unsplit_graph_warning() -> str:
    """Why a compiled model's graph reached gradsync unsplit, and what to do."""
    if _MISSING is not None:
        reason = f"this torch ({torch.__version__}) lacks {_MISSING}"
    else:
        reason = f"torch._dynamo.config.optimize_ddp is {split_mode()!r}, and only 'ddp_optimizer' splits graphs"
    return (
        f"gradsync: the model was compiled without a split at bucket boundaries ({reason}), so its backward is one "
        "autograd node and every bucket is reduced after it, with no overlap. Gradients are still averaged "
        "correctly. Set torch._dynamo.config.optimize_ddp = 'ddp_optimizer' (the default) to overlap."
    )


def split_mode() -> str:
    """dynamo's ``optimize_ddp`` mode: only ``"ddp_optimizer"`` (the default) splits graphs."""
    return str(torch._dynamo.utils.get_optimize_ddp_mode())
