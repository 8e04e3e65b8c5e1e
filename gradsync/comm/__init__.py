"""Communication hooks: what crosses the network for each bucket."""

from gradsync.comm.default_hooks import allreduce_hook
from gradsync.comm.grad_bucket import GradBucket

__all__ = ["GradBucket", "allreduce_hook"]
