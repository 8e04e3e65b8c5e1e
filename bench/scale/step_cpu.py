"""``python -m bench.scale.step_cpu``: the CPU one step costs with torch's DDP and with gradsync at torch's settings, on
one rank (gloo, a group of one), the scaling lab's synthetic ResNet-50 (or GPT-2) with no prescribed compute, so what
is measured is DDP's own work. Steps alternate between the two DDPs and the same model unwrapped ("bare"); each
DDP's *reducer CPU* is its backward minus the bare one's, paired step by step. Printed: the medians, gradsync's
reducer CPU as a multiple of torch's C++ reducer's, and both DDPs' bucket sizes (the same caps must give the same
buckets).

    python -m bench.scale.step_cpu --steps 1500
    python -m bench.scale.step_cpu --steps 1500 --model gpt2
    python -m bench.scale.step_cpu --scale 1 --steps 60 --warmup 10   # the real model's bytes (25.6 M parameters)
    python -m bench.scale.step_cpu --scale 1 --steps 60 --warmup 10 --no-lending
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

import gradsync
from bench.scale.worker import torch_caps
from lab.zoo.synthetic import SHAPES, SyntheticModel

SCALE = 128.0


def _models(model: str, scale: float) -> dict[str, torch.nn.Module]:
    out: dict[str, torch.nn.Module] = {}
    for name, wrap in (
        ("torch", torch.nn.parallel.DistributedDataParallel),
        ("gradsync", gradsync.DistributedDataParallel),
    ):
        torch.manual_seed(0)
        out[name] = wrap(SyntheticModel(model, scale=scale, time_scale=0.0), bucket_cap_mb_list=torch_caps(scale))
    out["bare"] = SyntheticModel(model, scale=scale, time_scale=0.0)
    return out


def _bucket_sizes(models: dict[str, torch.nn.Module]) -> dict[str, list[int]]:
    ours = [b.buffer.numel() for b in models["gradsync"].reducer.buckets]  # type: ignore[union-attr]
    theirs = [b.buffer().numel() for b in models["torch"].reducer._get_zeros_like_grad_buckets()]  # type: ignore[union-attr]
    return {"torch": theirs, "gradsync": ours}


def _order(names: list[str], i: int) -> list[str]:
    """Each step's order rotates, so no model always runs right after another (caches, the allocator)."""
    k = i % len(names)
    return names[k:] + names[:k]


def _paired_median(a: list[float], b: list[float]) -> float:
    return statistics.median(x - y for x, y in zip(a, b)) * 1e3


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.scale.step_cpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--model", choices=sorted(SHAPES), default="resnet50")
    parser.add_argument("--scale", type=float, default=SCALE, help="parameter counts divided by this (and the caps)")
    parser.add_argument("--no-lending", action="store_true", help="gradsync copies averages back, as torch does")
    args = parser.parse_args(argv)
    if args.no_lending:
        os.environ["GRADSYNC_LENDING"] = "0"  # read when gradsync's model is built
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    torch.set_num_threads(1)
    models = _models(args.model, args.scale)
    x = torch.ones(1, requires_grad=True)
    forward: dict[str, list[float]] = {name: [] for name in models}
    backward: dict[str, list[float]] = {name: [] for name in models}
    for i in range(args.warmup + args.steps):
        for name in _order(list(models), i):
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
            f"{label}: bare {medians['bare']:.3f} ms, torch {medians['torch']:.3f} ms, gradsync "
            f"{medians['gradsync']:.3f} ms of CPU; gradsync - torch, paired median: {paired:+.3f} ms"
        )
    reducer = {name: _paired_median(backward[name], backward["bare"]) for name in ("torch", "gradsync")}
    print(
        f"reducer CPU per backward (DDP's backward - bare, paired median): torch {reducer['torch']:.3f} ms, "
        f"gradsync {reducer['gradsync']:.3f} ms: {reducer['gradsync'] / reducer['torch']:.2f} x torch's"
    )
    print(f"bucket sizes (elements): {_bucket_sizes(models)}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
