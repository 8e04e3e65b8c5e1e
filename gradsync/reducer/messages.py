"""What the reducer says when something is wrong: each message names the parameter, bucket or rank, and what to do."""

from __future__ import annotations

from collections.abc import Sequence

from gradsync.reducer.buckets import MIB, Bucket


def bucket_description(bucket: Bucket, n_buckets: int, names: Sequence[str]) -> str:
    shown = [names[i] for i in bucket.assigned]
    listed = ", ".join(shown[:6]) + (f", ... ({len(shown) - 6} more)" if len(shown) > 6 else "")
    return f"bucket {bucket.index} of {n_buckets} ({bucket.nbytes / MIB:.2f} MiB, params: {listed})"


def no_gradient(rank: int, missing: Sequence[str]) -> str:
    return (
        f"rank {rank}: {len(missing)} parameter(s) received no gradient in this backward pass: "
        f"{', '.join(missing[:20])}{' ...' if len(missing) > 20 else ''}. Their bucket could not be reduced. "
        "If the model legitimately skips them (an unused head, a branch taken on some inputs only), pass "
        "find_unused_parameters=True to DistributedDataParallel; otherwise make sure every forward output "
        "that depends on them is part of the loss."
    )


def backward_after_reduction(name: str) -> str:
    return (
        f"backward() reached parameter '{name}' again after its gradients were already averaged for this "
        "forward. Run forward() before each backward(), or wrap extra backward passes in ddp.no_sync()."
    )


def ready_twice(name: str) -> str:
    return (
        f"parameter '{name}' became ready twice in one backward pass. This happens with reentrant "
        "backward (checkpointing with use_reentrant=True) or a parameter reported unused that still got a "
        "gradient; use use_reentrant=False, or find which rank's forward skipped the parameter."
    )
