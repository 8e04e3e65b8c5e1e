"""Who is calling the model, looked for up the stack at every synced forward: torch's own pipeline stage (which runs
data parallelism only for torch's DDP class) and ``torch.func.functional_call`` (which swaps the module's parameters
for one call). One walk of a few frames, a few microseconds; both change what the forward must do
(:mod:`gradsync.ddp.composition`)."""

from __future__ import annotations

import dataclasses
import inspect
import sys
from collections.abc import Mapping
from types import CodeType, FrameType

import torch
import torch.nn.utils.stateless

from gradsync.torch_private.pipelining import torch_stage_forward_codes

# The public spellings of functional_call; the deprecated one is wrapped by a decorator, whose original runs the call.
_FUNCTIONAL_CALLS = frozenset(
    inspect.unwrap(f).__code__ for f in (torch.func.functional_call, torch.nn.utils.stateless.functional_call)
)
_FUNCTIONAL_CALL = "functional_call"
# From the model's forward steps up to the caller: functional_call's helper, nn.Module's call, DDP's forward and its
# eager steps (about 13 frames in 2.13); room for a wrapper or two.
_FRAMES_UP = 24


@dataclasses.dataclass(frozen=True)
class Callers:
    """What was found up the stack of one forward."""

    torch_stage: str | None  # the class of torch's pipeline stage calling through torch's own forward path
    functional_call: bool  # inside torch.func.functional_call (or torch.nn.utils.stateless.functional_call)


def callers() -> Callers:
    """The callers of the running forward that change what it must do (:class:`Callers`)."""
    codes: dict[CodeType, str] = dict.fromkeys(_FUNCTIONAL_CALLS, _FUNCTIONAL_CALL)
    codes.update(dict.fromkeys(torch_stage_forward_codes(), "stage"))
    found = _walk(codes, sys._getframe(1))
    stage = found.get("stage")
    return Callers(type(stage).__name__ if stage is not None else None, _FUNCTIONAL_CALL in found)


def _walk(codes: Mapping[CodeType, str], frame: FrameType | None) -> dict[str, object]:
    """Each tag of ``codes`` whose frame is among the next :data:`_FRAMES_UP`, with that frame's ``self``."""
    found: dict[str, object] = {}
    for _ in range(_FRAMES_UP):
        if frame is None:
            break
        tag = codes.get(frame.f_code)
        if tag is not None and tag not in found:
            found[tag] = frame.f_locals.get("self")
        frame = frame.f_back
    return found
