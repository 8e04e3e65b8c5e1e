"""The front of data parallelism: the DistributedDataParallel module, its model checks, and its input handling."""

from gradsync.ddp.module import DistributedDataParallel

__all__ = ["DistributedDataParallel"]
