"""What one benchmark step is, for each variant: the same model and data, wrapped differently.

A variant spec is ``kind[:key=value,...]``: ``local`` (no communication), ``torch`` (torch's DDP), ``gradsync``,
``allreduce`` (only the all-reduce of every gradient, for the overlap bound). Keys: ``cap`` (bucket_cap_mb),
``view`` (gradient_as_bucket_view=1), ``hook`` (fp16 | bf16 | powersgd | torch-fp16 | torch-bf16),
``monitor`` (1: a gradsync.observe.Monitor attached), ``overlap`` (0: hold every bucket's all-reduce until the
last bucket is ready, i.e. no overlap with backward), ``accum`` (k: k micro-batches per step, k-1 under no_sync;
times are per micro-batch), ``opt`` (adam; default SGD with momentum), ``zero`` (1: gradsync.ShardedOptimizer
around it), ``overlap_opt`` (1: gradsync.optim.OverlappedOptimizer, stepping each bucket as it arrives),
``debug`` (1: check_desync=True, GRADSYNC_DEBUG's checks), ``bb`` (0: forward_sync_buffers=False, torch or
gradsync), ``tune`` (0: bucket_tuning=False, torch's fixed default buckets when no cap is given), ``static`` (1:
static_graph=True, torch or gradsync).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

import gradsync
from gradsync.optim.sharded import state_bytes
from lab.zoo.workloads import make


@dataclasses.dataclass
class Variant:
    spec: str
    model: nn.Module
    step: Callable[[object, Callable], dict[str, float]]
    grad_bytes: int
    wire_bytes: Callable[[], int]  # bytes all-reduced in the last step, as the hooks saw them
    memory: Callable[[], int]  # bytes of gradient storage (grads + buckets) after a step
    optimizer_state: Callable[[], int]  # bytes of optimizer state on this rank
    tuning: Callable[[], str | None]  # the bucket tuner's decision, if it made one
    graph_split: Callable[[], int | None]  # compiled gradsync: frames dynamo split at bucket boundaries


def parse(spec: str) -> tuple[str, dict[str, str]]:
    kind, _, rest = spec.partition(":")
    options = dict(item.split("=", 1) for item in rest.split(",") if item)
    return kind, options


def _storage_bytes(tensors) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None:
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _counting(hook, counter: list[int], bytes_per_value: float | None):
    def wrapped(state, bucket):
        width = bytes_per_value or bucket.buffer().element_size()
        counter[0] += int(bucket.buffer().numel() * width)
        return hook(state, bucket)

    return wrapped


def _hook(name: str):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    if name == "noop":  # no communication at all: what remains is the reducer's own cost

        def noop_hook(state, bucket):
            fut = torch.futures.Future()
            fut.set_result(bucket.buffer())
            return fut

        return noop_hook
    if name == "torch-fp16":
        return default_hooks.fp16_compress_hook
    if name == "torch-bf16":
        return default_hooks.bf16_compress_hook
    from gradsync import comm

    return {"fp16": comm.fp16_compress_hook, "bf16": comm.bf16_compress_hook}[name]


def _no_overlap_hook():
    """All-reduce nothing until the last bucket is ready, then every bucket: DDP without overlap (the paper's
    baseline for its overlap experiment)."""
    from gradsync.comm import allreduce_hook

    held: list = []

    def hook(state, bucket):
        pending: torch.futures.Future = torch.futures.Future()
        held.append((bucket, pending))
        if bucket.is_last():
            for b, fut in held:
                allreduce_hook(state, b).then(lambda f, fut=fut: fut.set_result(f.value()))
            held.clear()
        return pending

    return hook


def build(
    spec: str, model_name: str, seed: int = 0, compile_order: str | None = None, backend: str = "inductor"
) -> Variant:
    """``compile_order``: None (eager), ``"outer"`` (torch.compile(DDP(model))) or ``"inner"``
    (DDP(torch.compile(model)), nanoGPT's order); the variants without DDP compile the plain model."""
    kind, opts = parse(spec)
    torch.manual_seed(seed)
    module, _ = make(model_name)
    # A class of its own per variant: dynamo keys compiled code by the forward's code object, and the variants of
    # one run must not share a graph (split for one DDP's buckets, or not split at all for the local variant).
    module.__class__ = type(f"{type(module).__name__}_{len(_VARIANT_CLASSES)}", (type(module),), {})
    _VARIANT_CLASSES.append(module.__class__)
    wrapped = torch.compile(module, backend=backend) if compile_order == "inner" else module
    params = [p for p in module.parameters() if p.requires_grad]
    grad_bytes = sum(p.numel() * p.element_size() for p in params)
    opt_class, opt_kw = (
        (torch.optim.Adam, {"lr": 1e-4})
        if opts.get("opt") == "adam"
        else (torch.optim.SGD, {"lr": 1e-4, "momentum": 0.9})
    )
    if opts.get("zero") == "1":
        opt = gradsync.ShardedOptimizer(params, optimizer_class=opt_class, **opt_kw)
    else:
        opt = opt_class(params, **opt_kw)
    wire = [0]
    cap = (opts["cap"] if opts["cap"] == "auto" else float(opts["cap"])) if "cap" in opts else None

    buffer_kw = {"forward_sync_buffers": opts["bb"] != "0"} if "bb" in opts else {}  # torch >= 2.13's name
    if opts.get("static") == "1":
        buffer_kw["static_graph"] = True
    if kind == "local":
        net, ddp = module, None
    elif kind == "torch":
        net = ddp = torch.nn.parallel.DistributedDataParallel(wrapped, bucket_cap_mb=cap, **buffer_kw)
    elif kind == "gradsync":
        net = ddp = gradsync.DistributedDataParallel(
            wrapped,
            bucket_cap_mb=cap,
            gradient_as_bucket_view=opts.get("view") == "1",
            bucket_tuning=opts.get("tune", "1") != "0",  # the constructor's switches: this variant's alone
            check_desync=opts.get("debug") == "1",
            **buffer_kw,
        )
    elif kind == "allreduce":
        net, ddp = module, None
    else:
        raise ValueError(f"unknown variant kind '{kind}' in '{spec}'")
    if kind == "gradsync" and opts.get("overlap_opt") == "1":
        opt = gradsync.optim.OverlappedOptimizer(ddp, opt_class, **opt_kw)
    if kind == "gradsync" and opts.get("overlap") == "0":
        ddp.register_comm_hook(None, _no_overlap_hook())
    if kind == "gradsync" and opts.get("monitor") == "1":
        from gradsync.observe import Monitor

        Monitor(ddp, opt)
    if compile_order is not None:
        net = torch.compile(net, backend=backend) if compile_order == "outer" or ddp is None else net
    accum = int(opts.get("accum", "1"))
    # Only a requested hook is registered: a Python hook would take torch's DDP off its C++ all-reduce path.
    if ddp is not None and "hook" in opts:
        half = 2 if opts["hook"] in ("fp16", "bf16", "torch-fp16", "torch-bf16") else None
        ddp.register_comm_hook(dist.group.WORLD, _counting(_hook(opts["hook"]), wire, half))
    uncompressed = ddp is not None and "hook" not in opts

    def step(inputs, loss_fn) -> dict[str, float]:
        wire[0] = 0
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        for _ in range(accum - 1):  # local micro-batches: gradients accumulate, nothing is sent
            with ddp.no_sync():
                loss_fn(net(inputs)).backward()
        out = net(inputs)
        t1 = time.perf_counter()
        loss_fn(out).backward()
        t2 = time.perf_counter()
        if kind == "allreduce":  # what all-reducing every gradient costs on this link, bucketed at 25 MiB
            flat = [torch.cat([p.grad.reshape(-1) for p in params])]
            works = [dist.all_reduce(chunk, async_op=True) for chunk in flat[0].split(25 * 2**18)]
            for w in works:
                w.wait()
            wire[0] = grad_bytes
        t3 = time.perf_counter()
        opt.step()
        t4 = time.perf_counter()
        return {
            "forward": t1 - t0,
            "backward": t2 - t1,
            "allreduce": t3 - t2,
            "optimizer": t4 - t3,
            "total": (t4 - t0) / accum,
        }

    def memory() -> int:
        tensors = [p.grad for p in params]
        if kind == "gradsync":
            tensors += [b.buffer for b in ddp.reducer.buckets]
        return _storage_bytes(tensors)

    def optimizer_state() -> int:
        if isinstance(opt, (gradsync.ShardedOptimizer, gradsync.optim.OverlappedOptimizer)):
            return opt.local_state_bytes()
        return state_bytes(opt.state.values())

    wire_bytes = (lambda: grad_bytes) if uncompressed else (lambda: wire[0])

    def tuning() -> str | None:
        decision = getattr(getattr(ddp, "reducer", None), "tuning", None)
        return decision.describe() if decision is not None else None

    def graph_split() -> int | None:
        # where tests/test_compile.py reads it: the forward's steps own dynamo's split (gradsync/ddp/forward_steps.py)
        steps = getattr(ddp, "_forward_steps", None) if kind == "gradsync" else None
        split = getattr(steps, "graph_split", None)
        return split.frames_split if split is not None else None

    return Variant(spec, module, step, grad_bytes, wire_bytes, memory, optimizer_state, tuning, graph_split)


_VARIANT_CLASSES: list[type] = []
