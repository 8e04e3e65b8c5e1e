"""Optimizers that know they are distributed."""

from gradsync.optim.overlapped import OverlappedOptimizer
from gradsync.optim.sharded import ShardedOptimizer, ZeroRedundancyOptimizer, partition

__all__ = ["OverlappedOptimizer", "ShardedOptimizer", "ZeroRedundancyOptimizer", "partition"]
