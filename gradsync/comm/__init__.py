"""Communication hooks: what crosses the network for each bucket.

torch's default hooks (all-reduce, fp16/bf16 compression and their wrappers, :mod:`.default_hooks`) and PowerSGD
(Vogels et al., NeurIPS 2019) are torch's own implementations, re-exported: they run unchanged on gradsync's DDP and
give torch's DDP's results exactly (tests/test_comm_hooks.py), so gradsync does not write them again. What is
gradsync's own is what torch lacks: the 8/4-bit hook with error feedback, the two-level all-reduce for hosts of
several ranks (:mod:`.hierarchical`), local SGD methods (PostLocalSGD, DiLoCo,
Streaming DiLoCo), their outer exchange (:mod:`.outer_exchange`), averaging parameters through the model's
communicator, and a hook's state carried across an elastic regroup (:mod:`.regroup`).
"""

from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

from gradsync.comm.default_hooks import (
    allreduce_hook,
    bf16_compress_hook,
    bf16_compress_wrapper,
    fp16_compress_hook,
    fp16_compress_wrapper,
)
from gradsync.comm.diloco import DiLoCo
from gradsync.comm.hierarchical import HierarchicalState, hierarchical_hook
from gradsync.comm.local_sgd import PostLocalSGD, average_parameters
from gradsync.comm.quantized import QuantizedState, quantized_hook
from gradsync.comm.streaming_diloco import StreamingDiLoCo
from gradsync.reducer.grad_bucket import GradBucket
from gradsync.reducer.hook_order import issues_from_callbacks

__all__ = [
    "DiLoCo",
    "StreamingDiLoCo",
    "GradBucket",
    "QuantizedState",
    "quantized_hook",
    "HierarchicalState",
    "hierarchical_hook",
    "PowerSGDState",
    "powerSGD_hook",
    "PostLocalSGD",
    "average_parameters",
    "allreduce_hook",
    "bf16_compress_hook",
    "bf16_compress_wrapper",
    "fp16_compress_hook",
    "fp16_compress_wrapper",
    "issues_from_callbacks",
]
