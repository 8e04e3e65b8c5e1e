"""Communication hooks: what crosses the network for each bucket."""

from gradsync.comm.compression import (
    bf16_compress_hook,
    bf16_compress_wrapper,
    fp16_compress_hook,
    fp16_compress_wrapper,
)
from gradsync.comm.default_hooks import allreduce_hook
from gradsync.comm.grad_bucket import GradBucket
from gradsync.comm.local_sgd import PostLocalSGD, average_parameters

__all__ = [
    "GradBucket",
    "PostLocalSGD",
    "average_parameters",
    "allreduce_hook",
    "bf16_compress_hook",
    "bf16_compress_wrapper",
    "fp16_compress_hook",
    "fp16_compress_wrapper",
]
