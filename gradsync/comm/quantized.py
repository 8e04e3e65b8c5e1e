"""8-bit (or 4-bit) gradient averaging with error feedback, as a communication hook: a quarter of fp32's bytes.

Per bucket (Bagua's ByteGrad and 1-bit Adam's compressed all-reduce, in outline):

1. add this rank's error-feedback residual to the gradients, and split the bucket into one chunk per rank;
2. quantize each chunk in blocks of ``block`` values, one fp32 scale per block (symmetric, round to nearest);
3. reduce-scatter in int8: an all-to-all sends chunk r to rank r; each rank dequantizes what it received and sums
   its chunk;
4. requantize the summed chunk and all-gather it; everyone dequantizes and divides by the world size.

What quantization lost on the way out (step 2) is kept per bucket and added to the next step's gradients (error
feedback, Seide et al. 2014; Karimireddy et al. 2019), and so is what the owner of a chunk lost when requantizing
the sum (step 4), so the running sum of the averages applied tracks the running sum of the exact averages.

Both collectives of a bucket must be issued in the same order on every rank. The all-gather of bucket k needs
bucket k's all-to-all to have finished, so it is issued from the hook of bucket k+1 (or at the last bucket),
never from a callback on another thread, whose timing differs between ranks.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from gradsync.collectives.communicator import Communicator, Op
from gradsync.errors import ConfigError
from gradsync.reducer.grad_bucket import GradBucket, result_future
from gradsync.validate import require_bool, require_group, require_int


@dataclasses.dataclass
class QuantizedState:
    """Settings and per-bucket memory of :func:`quantized_hook`.

    Example::

        state = gradsync.comm.QuantizedState(process_group=None, bits=8)
        ddp.register_comm_hook(state, gradsync.comm.quantized_hook)
        ...
        state.bytes_sent  # what this rank put on the wire so far
    """

    process_group: dist.ProcessGroup | None = None
    bits: int = 8  # 8 or 4 (4: two values per byte)
    block: int = 256  # values per scale
    error_feedback: bool = True
    bytes_sent: int = 0
    _residuals: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    _owner_residuals: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    _pending: list[_Pending] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        require_group("QuantizedState", "process_group", self.process_group)
        if isinstance(self.bits, bool) or not isinstance(self.bits, int) or self.bits not in (4, 8):
            raise ConfigError(
                f"QuantizedState: bits must be 8 or 4 (an int), got {self.bits!r} ({type(self.bits).__name__})"
            )
        require_int("QuantizedState", "block (values per scale)", self.block, 1)
        require_bool("QuantizedState", "error_feedback", self.error_feedback)
        self.comm = Communicator(self.process_group)

    @property
    def levels(self) -> int:
        return 2 ** (self.bits - 1) - 1  # 127 or 7: symmetric around zero

    def for_new_group(self) -> None:
        """A membership change (:mod:`gradsync.comm.regroup`): the new default group, and no memory of the old one.
        The residuals were sized for the old buckets and world size, and a joining worker has none."""
        self.process_group = None
        self.comm = Communicator(None)
        self._residuals.clear()
        self._owner_residuals.clear()
        self._pending.clear()


@dataclasses.dataclass
class _Pending:
    """A bucket whose all-to-all is in flight; its all-gather is issued by the next hook call."""

    index: int
    buffer: torch.Tensor
    padded: int
    received: torch.Tensor
    work: Any
    result: torch.futures.Future


def quantized_hook(state: QuantizedState, bucket: GradBucket) -> torch.futures.Future:
    """Average the bucket with int8 (or int4) payloads and error feedback; torch's hook contract.

    >>> ddp.register_comm_hook(QuantizedState(bits=8), quantized_hook)  # doctest: +SKIP
    """
    _finish_pending(state)  # the previous bucket's all-gather goes first, in the same order everywhere
    pending = _start_reduce_scatter(state, bucket)
    state._pending.append(pending)
    if bucket.is_last():
        _finish_pending(state)
    return pending.result


def _start_reduce_scatter(state: QuantizedState, bucket: GradBucket) -> _Pending:
    buffer, world = bucket.buffer(), state.comm.size
    chunk = -(-buffer.numel() // world)
    chunk = -(-chunk // state.block) * state.block  # whole blocks per rank
    values = torch.zeros(chunk * world, dtype=torch.float32, device=buffer.device)
    values[: buffer.numel()] = buffer
    if state.error_feedback:
        residual = state._residuals.get(bucket.index())
        if residual is not None and residual.numel() == values.numel():
            values += residual
    # One (scales, integers) payload per destination rank, back to back: the all-to-all sends the r-th to rank r.
    pieces = [quantize(part, state) for part in values.chunk(world)]
    payload = torch.cat([p for p, _ in pieces])
    if state.error_feedback:
        previous = state._residuals.get(bucket.index())
        state._residuals[bucket.index()] = _next_residual(values, torch.cat([d for _, d in pieces]), previous)
    received = torch.empty_like(payload)
    work = state.comm.all_to_all_async(Op.QUANTIZED_SCATTER, received, payload, index=bucket.index())
    state.bytes_sent += payload.numel() * (world - 1) // world
    return _Pending(bucket.index(), buffer, values.numel(), received, work, result_future(buffer.device))


def _finish_pending(state: QuantizedState) -> None:
    while state._pending:
        pending = state._pending.pop(0)
        state.comm.wait(pending.work.get_future(), Op.QUANTIZED_SCATTER, pending.index)
        world = state.comm.size
        pieces = pending.received.chunk(world)
        mine = sum(dequantize(piece, pending.padded // world, state) for piece in pieces)
        assert isinstance(mine, torch.Tensor)
        residual = state._owner_residuals.get(pending.index) if state.error_feedback else None
        if residual is not None and residual.numel() == mine.numel():
            mine = mine + residual
        payload, dequantized = quantize(mine, state)
        if state.error_feedback:
            state._owner_residuals[pending.index] = _next_residual(mine, dequantized, residual)
        gathered = [torch.empty_like(payload) for _ in range(world)]
        work = state.comm.all_gather_async(Op.QUANTIZED_GATHER, gathered, payload, index=pending.index)
        state.bytes_sent += payload.numel() * (world - 1)
        work.get_future().then(_unpacker(pending, gathered, world, state))


def _unpacker(pending: _Pending, gathered: list[torch.Tensor], world: int, state: QuantizedState):
    def unpack(_fut: torch.futures.Future) -> None:
        chunk = pending.padded // world
        parts = [dequantize(piece, chunk, state) for piece in gathered]
        average = torch.cat(parts)[: pending.buffer.numel()].div_(world)
        pending.buffer.copy_(average)
        pending.result.set_result(pending.buffer)

    return unpack


def _next_residual(values: torch.Tensor, sent: torch.Tensor, previous: torch.Tensor | None) -> torch.Tensor:
    """What quantizing ``values`` to ``sent`` left out, carried into the next step; kept as it was (zeros at first)
    when ``values`` holds an inf or NaN. fp16 GradScaler overflows on purpose in its first steps and skips them;
    the error feedback skips them too, or its NaN would poison every later step. Decided on the device (no host
    sync): the averaged bucket is non-finite all the same, so GradScaler still sees the overflow."""
    residual = values - sent
    if previous is None or previous.shape != residual.shape:
        previous = torch.zeros_like(residual)
    return torch.where(torch.isfinite(values).all(), residual, previous)


# ------------------------------------------------------------------------------------------ quantization
def quantize(values: torch.Tensor, state: QuantizedState) -> tuple[torch.Tensor, torch.Tensor]:
    """(bytes: the scales then the packed integers, what they decode to). ``values.numel()`` is a multiple of
    ``state.block``."""
    blocks = values.view(-1, state.block)
    scales = blocks.abs().amax(dim=1).clamp(min=1e-30) / state.levels
    ints = torch.round(blocks / scales[:, None]).clamp_(-state.levels, state.levels).to(torch.int8)
    dequantized = (ints.to(torch.float32) * scales[:, None]).view(-1)
    packed = _pack4(ints.view(-1)) if state.bits == 4 else ints.view(-1)
    payload = torch.cat([scales.view(torch.uint8), packed.view(torch.uint8)])
    return payload, dequantized


def dequantize(payload: torch.Tensor, n: int, state: QuantizedState) -> torch.Tensor:
    """Inverse of :func:`quantize` for a chunk of ``n`` values."""
    n_blocks = n // state.block
    scales = payload[: n_blocks * 4].view(torch.float32)
    packed = payload[n_blocks * 4 :].view(torch.int8)
    ints = _unpack4(packed, n) if state.bits == 4 else packed
    return (ints.to(torch.float32).view(n_blocks, state.block) * scales[:, None]).view(-1)


def _pack4(ints: torch.Tensor) -> torch.Tensor:
    """Two 4-bit values (-7..7, stored + 8) per byte."""
    biased = (ints + 8).to(torch.uint8)
    if biased.numel() % 2:
        biased = torch.cat([biased, biased.new_zeros(1)])
    return (biased[0::2] | (biased[1::2] << 4)).view(torch.int8)


def _unpack4(packed: torch.Tensor, n: int) -> torch.Tensor:
    raw = packed.view(torch.uint8)
    low, high = (raw & 0x0F).to(torch.int16) - 8, (raw >> 4).to(torch.int16) - 8
    return torch.stack([low, high], dim=1).view(-1)[:n].to(torch.int8)
