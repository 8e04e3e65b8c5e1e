"""One rank of ``python -m bench.hierarchical``: torch's DDP, gradsync's with its flat all-reduce, gradsync's with
the two-level hook, and the model alone (no communication: the compute bound), each on its own copy of one MLP,
steps interleaved (bench/interleave.py). Rank 0 writes JSON."""

from __future__ import annotations

import argparse
import datetime
import statistics

import torch
import torch.distributed as dist
from torch import nn

import gradsync
from bench.interleave import time_interleaved
from gradsync.comm.hierarchical import HierarchicalState, hierarchical_hook
from lab.results import write_json


def _mlp(width: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(m for _ in range(layers) for m in (nn.Linear(width, width), nn.Tanh())))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--piece-kib", type=int, default=4096, help="what each step of the two-level pipeline takes")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    state = HierarchicalState(piece_bytes=args.piece_kib * 1024)
    models = {
        "local": _mlp(args.width, args.layers),
        "torch": torch.nn.parallel.DistributedDataParallel(_mlp(args.width, args.layers)),
        "gradsync": gradsync.DistributedDataParallel(_mlp(args.width, args.layers)),
        "gradsync:hierarchical": gradsync.DistributedDataParallel(_mlp(args.width, args.layers)),
    }
    models["gradsync:hierarchical"].register_comm_hook(state, hierarchical_hook)
    optimizers = {name: torch.optim.SGD(m.parameters(), lr=1e-3) for name, m in models.items()}
    x = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(dist.get_rank()))

    def step(name: str) -> None:
        optimizers[name].zero_grad()
        models[name](x).pow(2).mean().backward()
        optimizers[name].step()

    times, busy = time_interleaved({name: (lambda name=name: step(name)) for name in models}, args.warmup, args.steps)
    # The two-level hook must have averaged exactly what the flat one did: the replicas stay equal to torch's.
    drift = max(
        (a - b).abs().max().item()
        for a, b in zip(models["torch"].parameters(), models["gradsync:hierarchical"].parameters())
    )
    if dist.get_rank() == 0:
        gradient_bytes = 4 * sum(p.numel() for p in models["torch"].parameters())
        write_json(
            args.out,
            {
                "world_size": dist.get_world_size(),
                "hosts": state.hosts,
                "flat_because": state.flat_because,
                "gradient_mib": gradient_bytes / 2**20,
                "median_ms": {name: 1e3 * statistics.median(ts) for name, ts in times.items()},
                "ratio_vs_torch": {
                    name: statistics.median(a / b for a, b in zip(ts, times["torch"])) for name, ts in times.items()
                },
                "hierarchical_vs_torch_max_param_diff": drift,
                "cpu_busy_cores_all_ranks": busy,
            },
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
