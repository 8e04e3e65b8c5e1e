"""Desync detection (opt-in: ``GRADSYNC_DEBUG=1``): before each collective, the ranks compare a fingerprint of what
they are about to do and raise on every rank if they disagree.

Without it, ranks that took different paths (a rank that skipped a backward, a rank-dependent ``no_sync``) issue
different collectives that gloo and NCCL pair up anyway: a hang until the timeout, or silently wrong numbers. The
check costs one small all-gather per collective, so it is for debugging, not for production runs; the benchmark
reports its cost (``gradsync:debug=1``). The communicator (:mod:`.communicator`) calls :func:`check` before every
collective it issues, so the check covers every collective by construction, a joined rank's shadows included.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from gradsync.errors import DesyncError

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.uint8]


@dataclass(frozen=True)
class Fingerprint:
    """What a rank is about to do: the operation, the synced step it belongs to, its place in the communicator's
    sequence, its index (a bucket's; -1 for none), size and dtype."""

    op: int
    step: int
    sequence: int
    index: int
    numel: int
    dtype: int

    @classmethod
    def of(cls, op: int, step: int, sequence: int, index: int, tensor: torch.Tensor | None) -> Fingerprint:
        if tensor is None:
            return cls(op, step, sequence, index, 0, -1)
        code = _DTYPES.index(tensor.dtype) if tensor.dtype in _DTYPES else len(_DTYPES)
        return cls(op, step, sequence, index, tensor.numel(), code)

    def describe(self, names: dict[int, str]) -> str:
        what = names.get(self.op, f"operation {self.op}")
        if self.index >= 0:
            what += f" {self.index}"
        dtype = str(_DTYPES[self.dtype]).replace("torch.", "") if 0 <= self.dtype < len(_DTYPES) else "?"
        size = f" ({self.numel} x {dtype})" if self.dtype >= 0 else ""
        return f"{what}{size} in synced step {self.step}, collective #{self.sequence}"


def check(group: dist.ProcessGroup, mine: Fingerprint, device: torch.device, names: dict[int, str]) -> None:
    """All-gather this rank's fingerprint; raise :class:`DesyncError` on every rank if any rank differs.

    ``names`` maps operation codes to what they are, for the message; an index of -1 means the operation has none.
    """
    values = [mine.op, mine.step, mine.sequence, mine.index, mine.numel, mine.dtype]
    local = torch.tensor(values, dtype=torch.int64, device=device)
    everyone = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, local, group=group)
    prints = [Fingerprint(*t.tolist()) for t in everyone]
    if all(p == prints[0] for p in prints):
        return
    lines = "\n".join(f"  rank {dist.get_global_rank(group, r)}: {p.describe(names)}" for r, p in enumerate(prints))
    raise DesyncError(
        f"ranks are out of step (detected on rank {dist.get_rank()}); they are about to issue different "
        f"collectives:\n{lines}\nEvery rank must run the same sequence of forward/backward passes with the same "
        "no_sync()/require_backward_grad_sync choices; look for rank-dependent control flow (a skipped backward, "
        "an early 'continue', data-dependent no_sync)."
    )
