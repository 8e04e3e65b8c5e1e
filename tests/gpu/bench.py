"""The GPU benchmark (``bash tests/gpu/bench.sh``): gradsync's DDP against torch's on CUDA, side by side.

A GPT of ``--layers`` pre-norm transformer blocks (width 768, 12 heads, sequences of 256) trains in bf16 autocast
with AdamW. Both DDPs live in the same processes, steps interleaved with the order reversed every other round; each
step is timed with CUDA events (device time from the forward's start to the optimizer step's end), and the host
time of ``backward()`` (autograd plus the reducer's Python or C++) with the wall clock. Eager, then compiled
(``torch.compile(ddp)``). Peak memory: each DDP alone, 3 steps, ``torch.cuda.max_memory_allocated`` over the model's.

Then mixed precision: ``mixed_precision=`` (bf16 compute, fp32 reduction) in gradsync's DDP and in torch's (its
``_MixedPrecision``), and gradsync's DDP under autocast over fp32 parameters: step time interleaved, peak memory,
and the largest loss difference between gradsync's and torch's mixed precision over the same steps.

Several GPUs: NCCL, one rank a GPU. One GPU: two gloo ranks share it (gloo carries CUDA tensors through the host),
which shows the host side and memory, not NCCL's overlap. Prints one line per figure; under 5 minutes on an H200.
"""

from __future__ import annotations

import argparse
import statistics
import time
import types

import torch
import torch.distributed as dist
from torch import nn

import gradsync
from gradsync.testing import spawn

WIDTH, HEADS, SEQUENCE, VOCAB = 768, 12, 256, 8192


class GPT(nn.Module):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, WIDTH), nn.Embedding(SEQUENCE, WIDTH)
        block = lambda: nn.TransformerEncoderLayer(WIDTH, HEADS, 4 * WIDTH, 0.0, batch_first=True, norm_first=True)  # noqa: E731
        self.blocks = nn.ModuleList(block() for _ in range(layers))
        self.head = nn.Linear(WIDTH, VOCAB)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(SEQUENCE), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos.weight[: idx.shape[1]]
        for b in self.blocks:
            x = b(x, src_mask=self.mask, is_causal=True)
        return self.head(x)


def _own_forward(impl: str) -> type:
    """GPT with a forward code object of its own per DDP: dynamo caches compiled code by code object, and without
    parameter guards the second DDP would reuse the first one's graph, split at the first one's buckets."""
    code = GPT.forward.__code__.replace(co_name=f"forward_{impl}")
    return type(f"GPT_{impl}", (GPT,), {"forward": types.FunctionType(code, GPT.forward.__globals__)})


def _build(impl: str, layers: int, device: torch.device, compiled: bool):
    torch.manual_seed(0)
    model = _own_forward(impl)(layers).to(device)
    wrap = gradsync.DistributedDataParallel if impl == "gradsync" else nn.parallel.DistributedDataParallel
    ddp = wrap(model, device_ids=[device.index])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return (torch.compile(ddp) if compiled else ddp), optimizer


def _step(model, optimizer, idx: torch.Tensor, autocast: bool = True, losses: list | None = None) -> tuple:
    """(device ms, host ms of backward()); the loss appended to ``losses`` if given."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        logits = model(idx)
    loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), idx.flatten())
    if losses is not None:
        losses.append(loss.detach())
    host = time.perf_counter()
    loss.backward()
    host = time.perf_counter() - host
    optimizer.step()
    end.record()
    end.synchronize()
    return start.elapsed_time(end), 1e3 * host


def _rank(rank: int, world: int, layers: int, batch: int, steps: int, warmup: int) -> dict:
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    idx = torch.randint(0, VOCAB, (batch, SEQUENCE), generator=torch.Generator().manual_seed(rank)).to(device)
    out: dict = {}
    for compiled in (False, True):
        built = {impl: _build(impl, layers, device, compiled) for impl in ("torch", "gradsync")}
        times: dict[str, list[tuple[float, float]]] = {impl: [] for impl in built}
        for i in range(warmup + steps):
            for impl in list(built) if i % 2 == 0 else list(built)[::-1]:
                dist.barrier()
                t = _step(*built[impl], idx)
                if i >= warmup:
                    times[impl].append(t)
        mode = "compiled" if compiled else "eager"
        for impl, ts in times.items():
            out[f"{mode} {impl} step ms"] = statistics.median(t[0] for t in ts)
            out[f"{mode} {impl} backward host ms"] = statistics.median(t[1] for t in ts)
        out[f"{mode} step ratio gradsync/torch"] = statistics.median(
            a[0] / b[0] for a, b in zip(times["gradsync"], times["torch"])
        )
        del built
    out.update(_mixed_precision(layers, device, idx, steps, warmup))
    for impl in ("torch", "gradsync"):
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        model, optimizer = _build(impl, layers, device, False)
        for _ in range(3):
            _step(model, optimizer, idx)
        out[f"peak memory {impl} MiB"] = (torch.cuda.max_memory_allocated(device) - base) / 2**20
        del model, optimizer
    return out


def _build_mixed(variant: str, layers: int, device: torch.device):
    """``mixed_precision=`` (bf16 compute, fp32 reduction) in gradsync's and torch's DDP, and gradsync's DDP under
    autocast over fp32 parameters."""
    from torch.nn.parallel.distributed import _MixedPrecision

    torch.manual_seed(0)
    model = _own_forward(variant.replace("-", "_"))(layers).to(device)
    if variant == "gradsync-autocast":
        ddp = gradsync.DistributedDataParallel(model, device_ids=[device.index])
    elif variant == "gradsync-mixed":
        policy = gradsync.MixedPrecision(torch.bfloat16, torch.float32, torch.bfloat16)
        ddp = gradsync.DistributedDataParallel(model, device_ids=[device.index], mixed_precision=policy)
    else:
        policy = _MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16)
        ddp = nn.parallel.DistributedDataParallel(model, device_ids=[device.index], mixed_precision=policy)
    return ddp, torch.optim.AdamW(model.parameters(), lr=1e-4)


def _mixed_precision(layers: int, device: torch.device, idx: torch.Tensor, steps: int, warmup: int) -> dict:
    """The three variants interleaved: step time, and the largest loss difference between gradsync's and torch's
    mixed precision over the steps (the same seed, data and policy: equal up to bf16's kernels' nondeterminism)."""
    variants = ("gradsync-mixed", "torch-mixed", "gradsync-autocast")
    built = {v: _build_mixed(v, layers, device) for v in variants}
    times: dict[str, list[float]] = {v: [] for v in variants}
    losses: dict[str, list] = {v: [] for v in variants}
    for i in range(warmup + steps):
        for v in variants if i % 2 == 0 else variants[::-1]:
            dist.barrier()
            t = _step(*built[v], idx, autocast=v.endswith("autocast"), losses=losses[v])
            if i >= warmup:
                times[v].append(t[0])
    out: dict = {f"mixed {v} step ms": statistics.median(ts) for v, ts in times.items()}
    out["mixed step ratio gradsync/torch"] = statistics.median(
        a / b for a, b in zip(times["gradsync-mixed"], times["torch-mixed"])
    )
    gaps = [abs(a.item() - b.item()) for a, b in zip(losses["gradsync-mixed"], losses["torch-mixed"])]
    out["mixed max loss gap gradsync/torch"] = max(gaps)
    del built
    for v in variants:
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        model, optimizer = _build_mixed(v, layers, device)
        for _ in range(3):
            _step(model, optimizer, idx, autocast=v.endswith("autocast"))
        out[f"mixed {v} peak memory MiB"] = (torch.cuda.max_memory_allocated(device) - base) / 2**20
        del model, optimizer
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    gpus = torch.cuda.device_count()
    if gpus == 0:
        raise SystemExit("tests/gpu/bench.py needs a CUDA GPU")
    world, backend = (min(gpus, 8), "nccl") if gpus >= 2 else (2, "gloo")
    print(
        f"torch {torch.__version__}, {torch.cuda.get_device_name(0)} x {gpus}: {world} ranks on {backend}", flush=True
    )
    results = spawn(
        _rank, world_size=world, args=(args.layers, args.batch, args.steps, args.warmup), timeout=280, backend=backend
    )
    for key in results[0]:
        values = [r[key] for r in results]
        print(f"{key:<40} {statistics.median(values):9.3f}   (ranks: {', '.join(f'{v:.3f}' for v in values)})")
    ratio = statistics.median(r["peak memory gradsync MiB"] / r["peak memory torch MiB"] for r in results)
    print(f"{'peak memory ratio gradsync/torch':<40} {ratio:9.3f}")


if __name__ == "__main__":
    main()
