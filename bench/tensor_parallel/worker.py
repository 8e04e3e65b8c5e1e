"""One rank of ``python -m bench.tensor_parallel``: both DDPs over their own copy of the same tensor-parallel model,
in this process, steps interleaved (order alternating) after a barrier each, so drift hits both alike. Also the
resident memory each DDP's construction adds, and the bytes of gradient each data-parallel rank averages. Rank 0
writes JSON."""

from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import gradsync
from bench.interleave import time_interleaved
from lab.results import write_json


def _rss_mib() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _model(dim: int, layers: int, mesh) -> nn.Module:
    torch.manual_seed(0)
    blocks = [
        nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        for _ in range(layers)
    ]
    model = nn.Sequential(*blocks)
    plan = {f"{i}.1": ColwiseParallel() for i in range(layers)} | {f"{i}.3": RowwiseParallel() for i in range(layers)}
    return parallelize_module(model, mesh["tp"], plan)


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
    wrappers = {"torch": torch.nn.parallel.DistributedDataParallel, "gradsync": gradsync.DistributedDataParallel}
    models, optimizers, memory = {}, {}, {}
    for name, wrap in wrappers.items():
        module = _model(args.dim, args.layers, mesh)
        before = _rss_mib()
        models[name] = wrap(module, device_mesh=mesh["dp"])
        memory[name] = _rss_mib() - before
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
        ratios = [ours / theirs for ours, theirs in zip(times["gradsync"], times["torch"])]
        write_json(
            args.out,
            {
                "dim": args.dim,
                "layers": args.layers,
                "tokens": args.tokens,
                "steps": args.steps,
                "median_ms": {name: 1e3 * statistics.median(ts) for name, ts in times.items()},
                "ratio_gradsync_vs_torch": statistics.median(ratios),
                "construction_rss_mib": memory,
                "averaged_mib_per_dp_rank": local_bytes / 2**20,
                "cpu_busy_cores_all_ranks": busy,
            },
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
