"""What the reducer says when something is wrong: each message names the parameter, bucket or rank, and what to do."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from gradsync.reducer.buckets import MIB, AnyBucket


def bucket_description(bucket: AnyBucket, n_buckets: int, names: Sequence[str]) -> str:
    shown = [names[i] for i in bucket.assigned]
    listed = ", ".join(shown[:6]) + (f", ... ({len(shown) - 6} more)" if len(shown) > 6 else "")
    return f"bucket {bucket.index} of {n_buckets} ({bucket.nbytes / MIB:.2f} MiB, params: {listed})"


# torch's DDP reports a reduction that never finished at the next forward, in these words; quoted so that
# searches for torch's message find gradsync's too.
TORCH_PHRASE = "Expected to have finished reduction in the prior iteration before starting a new one"


def no_gradient(rank: int, missing: Sequence[str], mode_hint: str) -> str:
    return (
        f"rank {rank}: {len(missing)} parameter(s) received no gradient in this backward pass: "
        f"{', '.join(missing[:20])}{' ...' if len(missing) > 20 else ''}. Their bucket could not be reduced "
        f'(torch\'s DDP says, one iteration later: "{TORCH_PHRASE}"). {mode_hint}'
    )


def unused_hint(find_unused_parameters: bool, static_graph: bool = False) -> str:
    """What to do about parameters without a gradient, for the flags in use."""
    if static_graph:  # torch's words for this case, after its TORCH_PHRASE
        return (
            "This error indicates that your training graph has changed in this iteration, e.g., one parameter is "
            "used in first iteration, but then got unused in the second iteration. this is not compatible with "
            "static_graph set to True: pass static_graph=False (with find_unused_parameters=True if some "
            "parameters are sometimes unused)."
        )
    # torch's phrases ("passing the keyword argument `find_unused_parameters=True`", "`forward` function outputs
    # participate in calculating loss") are kept, so that searches for torch's message find this one.
    if find_unused_parameters:
        return (
            "Since `find_unused_parameters=True` is enabled, these were reached from the outputs and still got no "
            "gradient: make sure all `forward` function outputs participate in calculating loss on this rank, or "
            "that backward did not stop early (torch.autograd.grad with inputs=)."
        )
    return (
        "If the model legitimately skips them (an unused head, a branch taken on some inputs only), enable unused "
        "parameter detection by passing the keyword argument `find_unused_parameters=True` to "
        "DistributedDataParallel; otherwise make sure all `forward` function outputs participate in calculating "
        "loss."
    )


def unfinished_reduction(rank: int, missing: Sequence[str]) -> str:
    return (
        f"rank {rank}: {TORCH_PHRASE}: the previous backward never finished averaging; "
        f"{len(missing)} parameter(s) got no gradient: {', '.join(missing[:20])}{' ...' if len(missing) > 20 else ''}. "
        "Pass find_unused_parameters=True if the model skips them, or make every output that depends on them part "
        "of the loss."
    )


def backward_after_reduction(names: Sequence[str]) -> Callable[[int], str]:
    def message(index: int) -> str:
        return (
            f"gradsync (GRADSYNC_DEBUG): backward() reached parameter '{names[index]}' after its gradients were "
            "already averaged for this forward; as with torch's DDP, this gradient stays local (unaveraged). Run "
            "forward() before each backward(), or wrap extra backward passes in ddp.no_sync() to say it is meant."
        )

    return message


def ready_twice(name: str) -> str:
    return (
        f"parameter '{name}' became ready twice in one backward pass (torch: \"Expected to mark a variable ready "
        'only once"). This happens when a parameter is used both inside and outside a reentrant checkpoint '
        "(use_reentrant=True), or is reached by two backward passes of one forward; pass static_graph=True if the "
        "graph is the same every iteration, or use use_reentrant=False."
    )


def graph_changed(name: str) -> str:
    return (
        f"Your training graph has changed in this iteration: parameter '{name}' got a gradient, but under "
        "static_graph=True it was unused in the first iteration, which stands for every later one. Pass "
        "static_graph=False (with find_unused_parameters=True if some parameters are sometimes unused)."
    )


def hook_identity(hook: object, state: object) -> str:
    """What a rank's comm hook is, comparable across ranks: its qualified name and its state's type."""
    if hook is None:
        return "no comm hook (the built-in all-reduce)"
    target = getattr(hook, "func", hook)  # functools.partial
    name = f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', type(target).__name__)}"
    return f"comm hook {name} with state {type(state).__name__}"


def hook_mismatch(everyone: Sequence[str], global_rank: Callable[[int], int]) -> str:
    groups: dict[str, list[int]] = {}
    for rank, identity in enumerate(everyone):
        groups.setdefault(identity, []).append(global_rank(rank))
    listed = "; ".join(f"rank(s) {ranks}: {identity}" for identity, ranks in groups.items())
    return (
        f"every rank must reduce gradients the same way, but {listed}. Call register_comm_hook with the same hook "
        "on every rank (not under `if rank == 0:`), before the first backward."
    )


def compiled_autograd() -> str:
    return (
        "compiled autograd (torch._dynamo.config.compiled_autograd with backward() inside a compiled function) "
        "traces the gradient hooks, and gradsync's reducer is Python that must run eagerly: it cannot be traced. "
        "Call loss.backward() outside the compiled function, or set torch._dynamo.config.compiled_autograd = "
        "False; the compiled forward still overlaps each bucket's all-reduce with backward "
        "(torch._dynamo.config.optimize_ddp='ddp_optimizer', the default)."
    )


def per_bucket_with_dtensors(names: Sequence[str], sharded: Sequence[int]) -> str:
    return (
        f"a per-bucket callback (OverlappedOptimizer) cannot step tensor-parallel DTensor parameters "
        f"({', '.join(names[i] for i in sharded[:5])}{' ...' if len(sharded) > 5 else ''}): their buckets hold local "
        "shards, and the DTensor gradients are made only once every bucket has landed. Use a plain optimizer over "
        "the model's parameters (torch.optim.AdamW(ddp.parameters())) with tensor parallelism."
    )


def non_finite_gradient(rank: int, name: str, bucket: int) -> str:
    return (
        f"rank {rank}: parameter '{name}' has a NaN or inf gradient (bucket {bucket}), found before it was averaged "
        "into every replica (check_for_nan_in_grad=True). Look at this rank's batch and loss (a NaN loss, a "
        "division by zero, an overflow in low precision: a loss scaler, or bfloat16 instead of float16)."
    )
