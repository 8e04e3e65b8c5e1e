"""Gradient reduction: bucket layout, the per-backward step, the rebuild and tuner, and the naive reference."""

from gradsync.reducer.buckets import Bucket, assign_buckets
from gradsync.reducer.layout import BucketLayout
from gradsync.reducer.mode import GraphMode
from gradsync.reducer.naive import average_gradients
from gradsync.reducer.reducer import Reducer

__all__ = ["Bucket", "BucketLayout", "GraphMode", "Reducer", "assign_buckets", "average_gradients"]
