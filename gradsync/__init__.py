"""gradsync: data-parallel training for PyTorch, in readable Python. A drop-in for torch's DDP."""

# gradsync.checkpoint.save(...) and gradsync.elastic.init(...) after a plain `import gradsync`
from gradsync import checkpoint, elastic
from gradsync.data import DistributedLoader, DistributedSampler, LengthGroupedSampler
from gradsync.ddp import DistributedDataParallel
from gradsync.ddp.mixed_precision import MixedPrecision
from gradsync.errors import GradsyncError
from gradsync.nn import SyncBatchNorm
from gradsync.optim import ShardedOptimizer, ZeroRedundancyOptimizer
from gradsync.reducer.grad_bucket import GradBucket
from gradsync.runtime.env import DistInfo, init, shutdown

__version__ = "0.1.0"

__all__ = [
    "DistInfo",
    "DistributedDataParallel",
    "DistributedLoader",
    "DistributedSampler",
    "GradBucket",
    "GradsyncError",
    "LengthGroupedSampler",
    "MixedPrecision",
    "ShardedOptimizer",
    "SyncBatchNorm",
    "ZeroRedundancyOptimizer",
    "__version__",
    "checkpoint",
    "elastic",
    "init",
    "shutdown",
]
