"""Layers that know they are distributed (named as in ``torch.nn``): ``SyncBatchNorm``, batch statistics over every
rank's batch."""

from gradsync.nn.sync_batchnorm import SyncBatchNorm

__all__ = ["SyncBatchNorm"]
