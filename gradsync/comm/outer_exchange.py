"""The outer exchange of a local method (DiLoCo, Streaming DiLoCo): the average across ranks of a flat fp32
pseudo-gradient, started now and read later, on the wire in fp32, bf16, or 8- or 4-bit blocks (one fp32 scale per
256 values, :mod:`.quantized`'s format, no error feedback: the outer step is taken once per period, and DiLoCo's
authors and INTELLECT-1 quantize it without).

Started and finished apart so that Streaming DiLoCo (Douillard et al., 2025) can overlap a fragment's exchange
with the inner steps that follow; DiLoCo finishes at once.

Example::

    exchange = start_average(ddp.communicator, pseudo_gradient, wire="int4")
    ...                      # more inner steps meanwhile
    average = exchange.result()
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from gradsync.collectives.communicator import Communicator, Op
from gradsync.comm.quantized import QuantizedState, dequantize, quantize
from gradsync.errors import ConfigError

WIRES = (None, "bf16", "int8", "int4")


@torch.no_grad()
def pseudo_gradient(anchors: list[torch.nn.Parameter], params: list[torch.nn.Parameter]) -> torch.Tensor:
    """The parameters at the last outer step minus those now, flat, in fp32: what the ranks average."""
    return torch.cat([(anchor - p).reshape(-1) for anchor, p in zip(anchors, params)]).float()


@torch.no_grad()
def apply_outer_step(
    outer: torch.optim.Optimizer,
    anchors: list[torch.nn.Parameter],
    params: list[torch.nn.Parameter],
    average: torch.Tensor,
    mixing: float = 0.0,
) -> None:
    """The outer optimizer moves ``anchors`` along the averaged pseudo-gradient; the parameters then take the new
    anchors (``mixing`` 0, DiLoCo) or ``mixing * params + (1 - mixing) * anchors`` (Streaming DiLoCo's merge)."""
    for anchor, piece in zip(anchors, average.split([a.numel() for a in anchors])):
        anchor.grad = piece.view_as(anchor).to(anchor.dtype)
    outer.step()
    for p, anchor in zip(params, anchors):
        if mixing:
            p.mul_(mixing).add_(anchor, alpha=1.0 - mixing)
        else:
            p.copy_(anchor)


@torch.no_grad()
def reset_anchors(anchors: list[torch.nn.Parameter], params: list[torch.nn.Parameter]) -> None:
    """During a synchronous warm-up: the outer loop starts from where it ends."""
    for anchor, p in zip(anchors, params):
        anchor.copy_(p)


def check_wire(owner: str, wire: str | None) -> str | None:
    if wire not in WIRES:
        raise ConfigError(f"{owner}: compression must be one of {WIRES}, got {wire!r}")
    return wire


@dataclass
class Exchange:
    """An average in flight: :meth:`result` waits for it (once) and returns the fp32 average."""

    finish: Callable[[], torch.Tensor]
    bytes_sent: int  # what this rank puts on the wire for it

    def result(self) -> torch.Tensor:
        return self.finish()


def start_average(comm: Communicator, flat: torch.Tensor, wire: str | None, index: int = -1) -> Exchange:
    """Start averaging ``flat`` (fp32, 1-D) across ``comm``'s ranks; ``index`` names it in errors (a fragment)."""
    if wire in ("int8", "int4"):
        return _start_quantized(comm, flat, 8 if wire == "int8" else 4, index)
    world = comm.size
    on_wire = flat.to(torch.bfloat16) if wire == "bf16" else flat.clone()
    future = comm.all_reduce_async(Op.PARAMETER_AVERAGE, on_wire, index)

    def finish() -> torch.Tensor:
        comm.wait(future, Op.PARAMETER_AVERAGE, index)
        return on_wire.float().div_(world)

    # A ring all-reduce sends 2 (N - 1) / N of the buffer from each rank.
    return Exchange(finish, 2 * on_wire.numel() * on_wire.element_size() * (world - 1) // world)


def _start_quantized(comm: Communicator, flat: torch.Tensor, bits: int, index: int) -> Exchange:
    """Each rank's quantized blocks all-gathered, summed after dequantizing: no re-quantized sum, so the average
    is exact given the blocks (an all-reduce cannot sum integers with per-rank scales)."""
    blocks = QuantizedState(None, bits=bits, error_feedback=False)
    padded = torch.zeros(-(-flat.numel() // blocks.block) * blocks.block, device=flat.device)
    padded[: flat.numel()] = flat
    payload, _ = quantize(padded, blocks)
    gathered = [torch.empty_like(payload) for _ in range(comm.size)]
    work = comm.all_gather_async(Op.PARAMETER_AVERAGE, gathered, payload, index)

    def finish() -> torch.Tensor:
        comm.wait(work.get_future(), Op.PARAMETER_AVERAGE, index)
        total = torch.zeros_like(padded)
        for piece in gathered:
            total += dequantize(piece, padded.numel(), blocks)
        return total[: flat.numel()].div_(comm.size)

    return Exchange(finish, payload.numel() * (comm.size - 1))
