"""Layers that know they are distributed (named as in ``torch.nn``)."""

from gradsync.nn.sync_batchnorm import SyncBatchNorm

__all__ = ["SyncBatchNorm"]
