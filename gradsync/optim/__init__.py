"""Optimizers that know they are distributed: ``ShardedOptimizer`` (ZeRO-1, each rank steps its shard) and
``OverlappedOptimizer`` (steps each bucket as its average arrives)."""

from gradsync.optim.overlapped import OverlappedOptimizer
from gradsync.optim.sharded import ShardedOptimizer, ZeroRedundancyOptimizer, partition

__all__ = ["OverlappedOptimizer", "ShardedOptimizer", "ZeroRedundancyOptimizer", "partition"]
