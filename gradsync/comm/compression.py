"""Compression hooks: all-reduce gradients in half precision, half the bytes on the wire.

Same arithmetic as torch's ``default_hooks.fp16_compress_hook`` / ``bf16_compress_hook`` (cast, divide by the world
size, all-reduce, copy back), so a model trained with either gets the same numbers. The ``*_wrapper`` forms
compress around any other hook, like torch's ``fp16_compress_wrapper``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from gradsync.collectives.groups import resolve
from gradsync.comm.grad_bucket import GradBucket

Hook = Callable[[Any, GradBucket], torch.futures.Future]


def _compress_hook(dtype: torch.dtype, process_group: dist.ProcessGroup | None, bucket: GradBucket):
    group = resolve(process_group)
    buffer = bucket.buffer()
    compressed = buffer.to(dtype).div_(group.size())
    fut = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def decompress(fut: torch.futures.Future) -> torch.Tensor:
        buffer.copy_(fut.value()[0])
        return buffer

    return fut.then(decompress)


def fp16_compress_hook(process_group: dist.ProcessGroup | None, bucket: GradBucket) -> torch.futures.Future:
    """Average the bucket in float16 (half the bytes; fp16's range can overflow on very large gradients).

    >>> ddp.register_comm_hook(None, fp16_compress_hook)  # doctest: +SKIP
    """
    return _compress_hook(torch.float16, process_group, bucket)


def bf16_compress_hook(process_group: dist.ProcessGroup | None, bucket: GradBucket) -> torch.futures.Future:
    """Average the bucket in bfloat16 (half the bytes, float32's range, ~3 significant digits).

    >>> ddp.register_comm_hook(None, bf16_compress_hook)  # doctest: +SKIP
    """
    return _compress_hook(torch.bfloat16, process_group, bucket)


def _compress_wrapper(dtype: torch.dtype, hook: Hook) -> Hook:
    def wrapped(state: Any, bucket: GradBucket) -> torch.futures.Future:
        buffer = bucket.buffer()
        bucket.set_buffer(buffer.to(dtype))
        fut = hook(state, bucket)

        def decompress(fut: torch.futures.Future) -> torch.Tensor:
            buffer.copy_(fut.value())
            return buffer

        return fut.then(decompress)

    wrapped.__name__ = f"{dtype}_compress_wrapper({getattr(hook, '__name__', 'hook')})".replace("torch.", "")
    return wrapped


def fp16_compress_wrapper(hook: Hook) -> Hook:
    """Run ``hook`` on a float16 copy of each bucket, then copy the result back.

    >>> ddp.register_comm_hook(state, fp16_compress_wrapper(my_hook))  # doctest: +SKIP
    """
    return _compress_wrapper(torch.float16, hook)


def bf16_compress_wrapper(hook: Hook) -> Hook:
    """Run ``hook`` on a bfloat16 copy of each bucket, then copy the result back."""
    return _compress_wrapper(torch.bfloat16, hook)
