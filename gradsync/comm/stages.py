"""The two-level all-reduce's three steps as a pipeline over pieces of each bucket (gradsync/comm/hierarchical.py).

A bucket is cut into pieces of ``piece_bytes``; each piece is summed inside the host, its chunk all-reduced across
hosts, and the chunks gathered inside the host. Each step has one thread and a process group of its own, and takes
pieces in the order they came: so every group sees the same collectives in the same order on every rank (buckets
are averaged in bucket order), and while one piece crosses the hosts' link the next is summed and the one before
gathered. A gloo future's callbacks would run on the backend's threads in an order that differs between ranks.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

# torch 2.13 renamed all_gather_into_tensor (which now warns) to all_gather_single; 2.4 has only the first.
_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


class _Piece:
    """One piece of a bucket: ``padded`` (the bucket's own memory, or a copy padded to split evenly) and the chunk of
    it this rank carries across hosts."""

    def __init__(self, target: torch.Tensor, parts: int, index: int, done: Callable[[BaseException | None], None]):
        extra = (-target.numel()) % parts
        self.target = target
        self.padded = target if extra == 0 else torch.cat([target, target.new_zeros(extra)])
        self.chunk = self.padded.view(parts, -1)[index]
        self.done = done


class StagePipeline:
    """Sum in host → across hosts → gather in host, one thread and one group a step."""

    def __init__(
        self,
        groups: tuple[dist.ProcessGroup, dist.ProcessGroup, dist.ProcessGroup],
        ranks_per_host: int,
        local_index: int,
        piece_bytes: int,
    ) -> None:
        self._sum_group, self._across_group, self._gather_group = groups
        self._parts = ranks_per_host
        self._index = local_index
        self._piece_bytes = piece_bytes
        self._steps = [ThreadPoolExecutor(1, thread_name_prefix=f"gradsync-two-level-{i}") for i in range(3)]

    def average(self, tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
        """Sum ``tensor`` over the group, in place; the future completes when every piece is back."""
        result: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        per_piece = max(self._parts, self._piece_bytes // tensor.element_size() // self._parts * self._parts)
        targets = list(tensor.split(per_piece))
        left, lock = [len(targets)], threading.Lock()

        def piece_done(error: BaseException | None) -> None:
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if error is not None and not result.done():
                result.set_exception(error)  # type: ignore[arg-type]
            elif last and not result.done():
                result.set_result(tensor)

        for target in targets:
            self._steps[0].submit(self._guarded, self._sum, _Piece(target, self._parts, self._index, piece_done))
        return result

    def _guarded(self, step: Callable[[_Piece], None], piece: _Piece) -> None:
        try:
            step(piece)
        except BaseException as error:  # noqa: BLE001 - handed to the bucket's future, which the reducer reports
            piece.done(error)

    def _sum(self, piece: _Piece) -> None:
        dist.all_reduce(piece.padded, group=self._sum_group)
        self._steps[1].submit(self._guarded, self._across, piece)

    def _across(self, piece: _Piece) -> None:
        dist.all_reduce(piece.chunk, group=self._across_group)
        self._steps[2].submit(self._guarded, self._gather, piece)

    def _gather(self, piece: _Piece) -> None:
        _all_gather(piece.padded, piece.chunk.clone(), group=self._gather_group)
        if piece.padded is not piece.target:
            piece.target.copy_(piece.padded[: piece.target.numel()])
        piece.done(None)
