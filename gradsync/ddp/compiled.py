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

Everything private is named in :data:`PRIVATE_NAMES` (the ``compile`` records of :mod:`gradsync.torch_private`, with
the torch releases each was checked in) and checked when this module is imported: if torch has changed it, gradsync
warns once and trains as in eager mode (all buckets reduced after a compiled backward).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch
import torch._dynamo  # what torch.compiler.disable needs; any torch optimizer imports it too
from torch.nn.parallel import DistributedDataParallel as _TorchDDP

from gradsync import torch_private
from gradsync.reducer.buckets import DEFAULT_FIRST_BUCKET_BYTES

F = TypeVar("F", bound=Callable[..., Any])

# The records of gradsync.torch_private, which say where each is used and the torch releases it was checked in.
PRIVATE_NAMES = tuple(r.name for r in torch_private.PRIVATE_NAMES if r.seam.startswith("compile"))


def missing_seam() -> str | None:
    """What of the names dynamo's split needs the installed torch lacks, or None when the seam is all there."""
    lacking = torch_private.missing("compile")
    return " and ".join(lacking) if lacking else None


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
    return torch_private.optimize_ddp_mode()
