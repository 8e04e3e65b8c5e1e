"""``python -m bench.scale.step_cpu``: the CPU one step costs with torch's DDP and with gradsync at torch's settings, on
one rank (gloo, a group of one), the scaling lab's synthetic ResNet-50 with no prescribed compute, so what is
measured is DDP's own work: steps alternate between the two, and the paired differences' median is printed, with
both DDPs' bucket sizes (the same caps must give the same buckets).

    python -m bench.scale.step_cpu --steps 1500
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

import gradsync
from bench.scale.worker import torch_caps
from lab.zoo.synthetic import SyntheticModel

SCALE = 128.0


def _models() -> dict[str, torch.nn.Module]:
    out: dict[str, torch.nn.Module] = {}
    for name, wrap in (
        ("torch", torch.nn.parallel.DistributedDataParallel),
        ("gradsync", gradsync.DistributedDataParallel),
    ):
        torch.manual_seed(0)
        out[name] = wrap(SyntheticModel("resnet50", scale=SCALE, time_scale=0.0), bucket_cap_mb_list=torch_caps(SCALE))
    return out


def _bucket_sizes(models: dict[str, torch.nn.Module]) -> dict[str, list[int]]:
    ours = [b.buffer.numel() for b in models["gradsync"].reducer.buckets]  # type: ignore[union-attr]
    theirs = [b.buffer().numel() for b in models["torch"].reducer._get_zeros_like_grad_buckets()]  # type: ignore[union-attr]
    return {"torch": theirs, "gradsync": ours}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.scale.step_cpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--warmup", type=int, default=100)
    args = parser.parse_args(argv)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    torch.set_num_threads(1)
    models = _models()
    x = torch.ones(1, requires_grad=True)
    forward: dict[str, list[float]] = {name: [] for name in models}
    backward: dict[str, list[float]] = {name: [] for name in models}
    for i in range(args.warmup + args.steps):
        for name in list(models) if i % 2 else list(models)[::-1]:
            models[name].zero_grad(set_to_none=True)
            start = time.process_time()
            loss = models[name](x)
            middle = time.process_time()
            loss.backward()
            if i >= args.warmup:
                forward[name].append(middle - start)
                backward[name].append(time.process_time() - middle)
    for label, times in (("forward", forward), ("backward", backward)):
        medians = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        paired = statistics.median(g - t for g, t in zip(times["gradsync"], times["torch"])) * 1e3
        print(
            f"{label}: torch {medians['torch']:.3f} ms, gradsync {medians['gradsync']:.3f} ms of CPU; "
            f"gradsync - torch, paired median: {paired:+.3f} ms"
        )
    print(f"bucket sizes (elements): {_bucket_sizes(models)}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
