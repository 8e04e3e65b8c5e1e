"""Desync detection (opt-in: ``GRADSYNC_DEBUG=1``): before each collective gradsync issues, the ranks compare a
fingerprint of what they are about to do, and raise on every rank if they disagree.

Without it, ranks that took different paths (a rank that skipped a backward, a rank-dependent ``no_sync``) issue
different collectives that gloo and NCCL pair up anyway: a hang until the timeout, or silently wrong numbers. The
check costs one small all-gather per collective, so it is for debugging, not for production runs; the benchmark
reports its cost (``gradsync:debug=1``).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

OPS = {
    1: "all-reduce of bucket",
    2: "broadcast of module buffers",
    3: "broadcast of the rebuilt bucket order",
    4: "all-reduce of the used-parameter map",
}
ALLREDUCE_BUCKET, BROADCAST_BUFFERS, BROADCAST_REBUILD, ALLREDUCE_USED = 1, 2, 3, 4
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.uint8]


def enabled() -> bool:
    """Whether ``GRADSYNC_DEBUG`` asks for desync checks (read when a DistributedDataParallel is built)."""
    return os.environ.get("GRADSYNC_DEBUG", "").lower() in ("1", "true", "yes", "on")


def _describe(fp: list[int]) -> str:
    op, step, index, numel, dtype = fp
    what = OPS.get(op, f"operation {op}")
    if op == ALLREDUCE_BUCKET:
        what += f" {index}"
    dtype_name = str(_DTYPES[dtype]).replace("torch.", "") if 0 <= dtype < len(_DTYPES) else "?"
    return f"{what} ({numel} x {dtype_name}) in synced step {step}"


def check(group: dist.ProcessGroup | None, op: int, step: int, index: int, tensor: torch.Tensor) -> None:
    """All-gather this rank's fingerprint; raise ``RuntimeError`` on every rank if any rank differs."""
    code = _DTYPES.index(tensor.dtype) if tensor.dtype in _DTYPES else len(_DTYPES)
    mine = torch.tensor([op, step, index, tensor.numel(), code], dtype=torch.int64, device=tensor.device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    prints = [t.tolist() for t in everyone]
    if all(p == prints[0] for p in prints):
        return
    lines = "\n".join(
        f"  rank {dist.get_global_rank(group or dist.group.WORLD, r)}: {_describe(p)}" for r, p in enumerate(prints)
    )
    raise RuntimeError(
        f"gradsync: ranks are out of step (detected on rank {dist.get_rank()}); they are about to issue different "
        f"collectives:\n{lines}\nEvery rank must run the same sequence of forward/backward passes with the same "
        "no_sync()/require_backward_grad_sync choices; look for rank-dependent control flow (a skipped backward, "
        "an early 'continue', data-dependent no_sync)."
    )
