"""Optimizers that know they are distributed."""

from gradsync.optim.sharded import ShardedOptimizer, ZeroRedundancyOptimizer, partition

__all__ = ["ShardedOptimizer", "ZeroRedundancyOptimizer", "partition"]
