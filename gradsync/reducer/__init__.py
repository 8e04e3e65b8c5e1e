"""Gradient reduction. The path of one gradient is three files: :mod:`.reducer` (the owner), :mod:`.backward` (one
backward: the hooks, the step, how a bucket is reduced) and :mod:`.buckets` (where gradients live: buckets, their
layout, lending). Around them: bucket caps, the graph modes, the rebuild and tuner, and the naive reference."""

from gradsync.reducer.buckets import Bucket, BucketLayout, assign_buckets
from gradsync.reducer.mode import GraphMode
from gradsync.reducer.naive import average_gradients
from gradsync.reducer.reducer import Reducer

__all__ = ["Bucket", "BucketLayout", "GraphMode", "Reducer", "assign_buckets", "average_gradients"]
