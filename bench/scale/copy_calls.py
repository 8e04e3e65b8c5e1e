"""``python -m bench.scale.copy_calls``: what a gradient's way into its bucket costs from Python, by size, on one core:
``torch.mul(grad, 1 / world size, out=slot)`` per tensor (torch's arithmetic, one pass) against one
``torch._foreach_copy_`` and one ``mul_`` over the bucket (two passes, two calls); and what checking whether a
gradient may be lent its slot costs against copying it back. The reducer's threshold between a *large* gradient
(taken alone, lent back) and a small one (gathered, copied back together), ``EAGER_COPY_BYTES``, sits where these
cross (docs/scaling.md).

    python -m bench.scale.copy_calls
"""

from __future__ import annotations

import statistics
import sys
import timeit

import torch

from gradsync.reducer.buckets import lend
from gradsync.torch_private.storage import calibrate, can_count_storage_uses

SIZES_KIB = (16, 80, 256, 512, 2048)


def _per_tensor_us(numel: int, count: int) -> tuple[float, float]:
    """(a mul per tensor, a fused copy and one scaling), microseconds a tensor."""
    bucket = torch.empty(numel * count)
    slots = list(bucket.split(numel))
    grads = [torch.randn(numel) for _ in range(count)]

    def each() -> None:
        for grad, slot in zip(grads, slots):
            torch.mul(grad, 0.5, out=slot)

    def fused() -> None:
        torch._foreach_copy_(slots, grads)
        bucket.mul_(0.5)

    return tuple(min(timeit.repeat(f, number=20, repeat=5)) / 20 / count * 1e6 for f in (each, fused))  # type: ignore[return-value]


def _lend_or_copy_us(numel: int, count: int) -> tuple[float, float]:
    """(lending each fresh gradient its slot, copying the slots back in one fused copy), microseconds a tensor."""
    params = [torch.nn.Parameter(torch.zeros(numel)) for _ in range(count)]
    slots = list(torch.randn(numel * count).split(numel))
    lent, copied = [], []
    for _ in range(15):
        for param in params:
            param.grad = torch.empty(numel)
        lent.append(timeit.timeit(lambda: lend(params, slots), number=1))
        for param in params:
            param.grad = torch.empty(numel)
        copied.append(timeit.timeit(lambda: torch._foreach_copy_([p.grad for p in params], slots), number=1))
    return statistics.median(lent) / count * 1e6, statistics.median(copied) / count * 1e6


def main() -> int:
    torch.set_num_threads(1)
    lending = can_count_storage_uses()
    if lending:
        calibrate()
    print("size     mul each  fused copy+mul   lend  copy back   (us a tensor)")
    for kib in SIZES_KIB:
        numel, count = kib * 256, max(6, min(50, 4096 // kib))
        each, fused = _per_tensor_us(numel, count)
        lend_us, copy_us = _lend_or_copy_us(numel, count) if lending else (float("nan"), float("nan"))
        print(f"{kib:5d} KiB {each:8.1f} {fused:14.1f} {lend_us:8.1f} {copy_us:8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
