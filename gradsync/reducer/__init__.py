"""Gradient reduction: the reducer's hooks and phases, the per-backward step, how a bucket is reduced (the built-in
all-reduce or a comm hook, through ``GradBucket``), bucket caps, layout and buckets, the graph modes, the rebuild and
tuner, and the naive reference."""

from gradsync.reducer.buckets import Bucket, assign_buckets
from gradsync.reducer.layout import BucketLayout
from gradsync.reducer.mode import GraphMode
from gradsync.reducer.naive import average_gradients
from gradsync.reducer.reducer import Reducer

__all__ = ["Bucket", "BucketLayout", "GraphMode", "Reducer", "assign_buckets", "average_gradients"]
