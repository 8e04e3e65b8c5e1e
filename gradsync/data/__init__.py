"""Data sharding: torch-identical DistributedSampler, resumable, and a loader that tracks its position."""

from gradsync.data.loader import DistributedLoader
from gradsync.data.sampler import DistributedSampler

__all__ = ["DistributedLoader", "DistributedSampler"]
