"""Gradient reduction: bucket assignment, the fast overlapped reducer, and the naive reference."""

from gradsync.reducer.buckets import Bucket, assign_buckets
from gradsync.reducer.naive import average_gradients
from gradsync.reducer.reducer import Reducer

__all__ = ["Bucket", "Reducer", "assign_buckets", "average_gradients"]
