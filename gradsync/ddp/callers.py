"""Who is calling the model, looked for up the stack: torch's own pipeline stage (which runs data parallelism only for
torch's DDP class) and ``torch.func.functional_call`` (which swaps the module's parameters for one call). Each look
walks a few frames (microseconds), and only where it can find something: the first where torch's pipelining was
imported, the second where a parameter is no longer the module's (:class:`gradsync.ddp.composition.InUse`)."""

from __future__ import annotations

import inspect
import sys
from collections.abc import Collection
from types import CodeType, FrameType

import torch
import torch.nn.utils.stateless

from gradsync.torch_private.pipelining import torch_stage_forward_codes

# The public spellings of functional_call; the deprecated one is wrapped by a decorator, whose original runs the call.
_FUNCTIONAL_CALLS = frozenset(
    inspect.unwrap(f).__code__ for f in (torch.func.functional_call, torch.nn.utils.stateless.functional_call)
)
# The frames looked at: from the 7th above the look to the 18th. Below the 7th they are always gradsync's own and
# nn.Module's (InUse, the forward's steps, DDP's forward, nn.Module's call: the caller sits 8 above at the least,
# 10 in 2.13 with torch.compiler.disable's wrappers, functional_call's frame one more); above, room for
# torch.compile's wrappers (about 5 more frames). Skipping to the 7th costs nothing (sys._getframe walks in C); each
# frame looked at costs one frame object made for Python, so the look stops at the 18th.
_FIRST_FRAME = 7
_FRAMES_UP = 12


class TorchStageLook:
    """Looks for torch's pipeline stage calling the model through torch's own forward path. Free where torch's
    pipelining was never imported; its methods' code is read once it is."""

    def __init__(self) -> None:
        self._codes: frozenset[CodeType] = frozenset()

    def __call__(self) -> str | None:
        """The class of the stage calling, or None."""
        if not self._codes:
            self._codes = torch_stage_forward_codes()
            if not self._codes:
                return None
        return _stage_calling(self._codes)


def _stage_calling(codes: frozenset[CodeType]) -> str | None:
    frame = _frame_of(codes)
    return None if frame is None else type(frame.f_locals.get("self")).__name__


def inside_functional_call() -> bool:
    """Whether the running forward was called by ``torch.func.functional_call`` (or its deprecated spelling in
    ``torch.nn.utils.stateless``)."""
    return _frame_of(_FUNCTIONAL_CALLS) is not None


def _frame_of(codes: Collection[CodeType]) -> FrameType | None:
    """The first frame of those looked at (:data:`_FIRST_FRAME`, :data:`_FRAMES_UP`) that runs one of ``codes``."""
    try:
        frame: FrameType | None = sys._getframe(_FIRST_FRAME)
    except ValueError:  # a shallower stack: none of them is there
        return None
    wanted = [id(code) for code in codes]  # by identity: a code object's hash is recomputed at each lookup
    for _ in range(_FRAMES_UP):
        if frame is None or id(frame.f_code) in wanted:
            return frame
        frame = frame.f_back
    return None
