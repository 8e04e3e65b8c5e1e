"""gradsync: data-parallel training for PyTorch, in readable Python. A drop-in for torch's DDP."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gradsync.exports import lazy

__version__ = "0.1.0"

# Imported at first use (gradsync.exports says why): `import gradsync` stays light for the gradsync command.
__getattr__, __dir__ = lazy(
    __name__,
    {
        "checkpoint": "gradsync.checkpoint",
        "elastic": "gradsync.elastic",
        "DistributedLoader": "gradsync.data",
        "DistributedSampler": "gradsync.data",
        "LengthGroupedSampler": "gradsync.data",
        "DistributedDataParallel": "gradsync.ddp",
        "MixedPrecision": "gradsync.ddp.mixed_precision",
        "GradsyncError": "gradsync.errors",
        "SyncBatchNorm": "gradsync.nn",
        "ShardedOptimizer": "gradsync.optim",
        "ZeroRedundancyOptimizer": "gradsync.optim",
        "GradBucket": "gradsync.reducer.grad_bucket",
        "DistInfo": "gradsync.runtime.env",
        "init": "gradsync.runtime.env",
        "shutdown": "gradsync.runtime.env",
    },
)

if TYPE_CHECKING:
    from gradsync import checkpoint, elastic
    from gradsync.data import DistributedLoader, DistributedSampler, LengthGroupedSampler
    from gradsync.ddp import DistributedDataParallel
    from gradsync.ddp.mixed_precision import MixedPrecision
    from gradsync.errors import GradsyncError
    from gradsync.nn import SyncBatchNorm
    from gradsync.optim import ShardedOptimizer, ZeroRedundancyOptimizer
    from gradsync.reducer.grad_bucket import GradBucket
    from gradsync.runtime.env import DistInfo, init, shutdown


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
