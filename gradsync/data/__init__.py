"""Data sharding: torch-identical DistributedSampler, resumable, a loader that tracks its position, and batches
grouped by length (LengthGroupedSampler)."""

from gradsync.data.length_grouped import LengthGroupedSampler
from gradsync.data.loader import DistributedLoader
from gradsync.data.sampler import DistributedSampler

__all__ = ["DistributedLoader", "DistributedSampler", "LengthGroupedSampler"]
