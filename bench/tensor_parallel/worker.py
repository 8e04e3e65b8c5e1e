"""One rank of ``python -m bench.tensor_parallel``: both DDPs over their own copy of the same tensor-parallel model,
in this process, steps interleaved (order alternating) after a barrier each, so drift hits both alike. Also the
bytes of each DDP's gradient buckets, and the bytes of gradient each data-parallel rank averages. Rank 0
writes JSON."""

from __future__ import annotations

import argparse
import functools
import statistics

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import gradsync
from bench.interleave import time_interleaved
from lab.results import write_json


def _model(dim: int, layers: int, mesh) -> nn.Module:
    torch.manual_seed(0)
    blocks = [
        nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        for _ in range(layers)
    ]
    model = nn.Sequential(*blocks)
    plan = {f"{i}.1": ColwiseParallel() for i in range(layers)} | {f"{i}.3": RowwiseParallel() for i in range(layers)}
    return parallelize_module(model, mesh["tp"], plan)


def _bucket_mib(models: dict) -> dict[str, list[float]]:
    """Each DDP's gradient buckets, MiB (torch's from its logging data): what it allocates beyond the model."""
    out = {}
    for name, model in models.items():
        if name == "torch":
            sizes = model._get_ddp_logging_data().get("bucket_sizes", "")
            out[name] = [int(b) / 2**20 for b in str(sizes).split(", ") if b]
        else:
            out[name] = [b.buffer.numel() * b.buffer.element_size() / 2**20 for b in model.reducer.buckets]
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64, help="tokens per step, per data-parallel rank")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=__import__("datetime").timedelta(seconds=300))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    wrappers = {
        "torch": torch.nn.parallel.DistributedDataParallel,
        "gradsync": gradsync.DistributedDataParallel,
        "gradsync:tune=0": functools.partial(gradsync.DistributedDataParallel, bucket_tuning=False),
    }
    models, optimizers = {}, {}
    for name, wrap in wrappers.items():
        models[name] = wrap(_model(args.dim, args.layers, mesh), device_mesh=mesh["dp"])
        optimizers[name] = torch.optim.SGD(models[name].parameters(), lr=1e-3)  # before a forward: torch's swap
    local_bytes = sum(
        p.to_local().numel() * 4 if hasattr(p, "to_local") else p.numel() * 4 for p in models["gradsync"].parameters()
    )
    g = torch.Generator().manual_seed(mesh["dp"].get_local_rank())
    x = torch.randn(args.tokens, args.dim, generator=g)

    def step(name: str) -> None:
        optimizers[name].zero_grad()
        models[name](x).pow(2).mean().backward()
        optimizers[name].step()

    steps = {name: (lambda name=name: step(name)) for name in wrappers}
    times, busy = time_interleaved(steps, args.warmup, args.steps)
    if dist.get_rank() == 0:
        ratios = {name: statistics.median(a / b for a, b in zip(ts, times["torch"])) for name, ts in times.items()}
        write_json(
            args.out,
            {
                "dim": args.dim,
                "layers": args.layers,
                "tokens": args.tokens,
                "steps": args.steps,
                "median_ms": {name: 1e3 * statistics.median(ts) for name, ts in times.items()},
                "ratio_vs_torch": ratios,
                "bucket_mib": _bucket_mib(models),
                "averaged_mib_per_dp_rank": local_bytes / 2**20,
                "cpu_busy_cores_all_ranks": busy,
            },
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
