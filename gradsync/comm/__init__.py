"""Communication hooks: what crosses the network for each bucket.

PowerSGD (Vogels et al., NeurIPS 2019) is torch's own implementation, re-exported: it runs unchanged on gradsync's
DDP and gives torch's DDP's results exactly (tests/test_comm_hooks.py), so gradsync does not write it again.
"""

from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

from gradsync.comm.compression import (
    bf16_compress_hook,
    bf16_compress_wrapper,
    fp16_compress_hook,
    fp16_compress_wrapper,
)
from gradsync.comm.default_hooks import allreduce_hook
from gradsync.comm.diloco import DiLoCo
from gradsync.comm.grad_bucket import GradBucket
from gradsync.comm.local_sgd import PostLocalSGD, average_parameters
from gradsync.comm.quantized import QuantizedState, quantized_hook
from gradsync.comm.streaming_diloco import StreamingDiLoCo

__all__ = [
    "DiLoCo",
    "StreamingDiLoCo",
    "GradBucket",
    "QuantizedState",
    "quantized_hook",
    "PowerSGDState",
    "powerSGD_hook",
    "PostLocalSGD",
    "average_parameters",
    "allreduce_hook",
    "bf16_compress_hook",
    "bf16_compress_wrapper",
    "fp16_compress_hook",
    "fp16_compress_wrapper",
]
