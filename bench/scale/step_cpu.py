"""``python -m bench.scale.step_cpu``: the CPU one step costs with torch's DDP and with gradsync at torch's settings, on
one rank (gloo, a group of one), the scaling lab's synthetic ResNet-50 (or GPT-2) with no prescribed compute, so what
is measured is DDP's own work. Steps alternate between the two DDPs and the same model unwrapped ("bare"); each
DDP's *reducer CPU* is its backward minus the bare one's, paired step by step. Printed: the medians, gradsync's
reducer CPU as a multiple of torch's C++ reducer's, and both DDPs' bucket sizes (the same caps must give the same
buckets).

At the real models' sizes (``--scale 1``) three models in one process share one allocator: the gradients one model
frees are the memory the next one faults in again, so the page faults a step pays depend on which model ran before
it. ``--apart`` runs each of the three in a process of its own instead, the processes alternated ``--rounds``
times, and pairs the rounds' medians.

    python -m bench.scale.step_cpu --steps 1500
    python -m bench.scale.step_cpu --steps 1500 --model gpt2
    python -m bench.scale.step_cpu --scale 1 --steps 20 --warmup 5 --apart   # the real model's bytes (25.6 M)
    python -m bench.scale.step_cpu --scale 1 --steps 20 --warmup 5 --apart --no-lending
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

import gradsync
from bench.scale.worker import torch_caps
from lab.zoo.synthetic import SHAPES, SyntheticModel

SCALE = 128.0
NAMES = ("torch", "gradsync", "bare")


def build_model(name: str, model: str, scale: float) -> torch.nn.Module:
    """``name`` ("torch", "gradsync" or "bare") around the synthetic ``model`` at 1/``scale``, at torch's caps."""
    torch.manual_seed(0)
    bare = SyntheticModel(model, scale=scale, time_scale=0.0)
    if name == "bare":
        return bare
    wrap = torch.nn.parallel.DistributedDataParallel if name == "torch" else gradsync.DistributedDataParallel
    return wrap(bare, bucket_cap_mb_list=torch_caps(scale))


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


def _steps(models: dict[str, torch.nn.Module], steps: int, warmup: int) -> dict[str, dict[str, list[float]]]:
    """Each model's forward and backward CPU seconds per step, the models' steps interleaved."""
    x = torch.ones(1, requires_grad=True)
    times: dict[str, dict[str, list[float]]] = {"forward": {n: [] for n in models}, "backward": {n: [] for n in models}}
    for i in range(warmup + steps):
        for name in _order(list(models), i):
            models[name].zero_grad(set_to_none=True)
            start = time.process_time()
            loss = models[name](x)
            middle = time.process_time()
            loss.backward()
            if i >= warmup:
                times["forward"][name].append(middle - start)
                times["backward"][name].append(time.process_time() - middle)
    return times


def _apart(args: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    """Each model in a process of its own, alternated ``args.rounds`` times: one median per process and round."""
    times: dict[str, dict[str, list[float]]] = {"forward": {n: [] for n in NAMES}, "backward": {n: [] for n in NAMES}}
    for r in range(args.rounds):
        for name in _order(list(NAMES), r):
            command = [sys.executable, "-m", "bench.scale.step_cpu", "--only", name, "--model", args.model]
            command += ["--scale", str(args.scale), "--steps", str(args.steps), "--warmup", str(args.warmup)]
            out = subprocess.run(command, check=True, capture_output=True, text=True, env=os.environ).stdout
            one = json.loads(out.strip().splitlines()[-1])
            for label in times:
                times[label][name].append(statistics.median(one[label]))
    return times


def _report(times: dict[str, dict[str, list[float]]], pairing: str) -> None:
    for label, by_model in times.items():
        medians = {name: statistics.median(t) * 1e3 for name, t in by_model.items()}
        paired = _paired_median(by_model["gradsync"], by_model["torch"])
        print(
            f"{label}: bare {medians['bare']:.3f} ms, torch {medians['torch']:.3f} ms, gradsync "
            f"{medians['gradsync']:.3f} ms of CPU; gradsync - torch, paired median: {paired:+.3f} ms"
        )
    backward = times["backward"]
    reducer = {name: _paired_median(backward[name], backward["bare"]) for name in ("torch", "gradsync")}
    print(
        f"reducer CPU per backward (DDP's backward - bare, paired {pairing}): torch {reducer['torch']:.3f} ms, "
        f"gradsync {reducer['gradsync']:.3f} ms: {reducer['gradsync'] / reducer['torch']:.2f} x torch's"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.scale.step_cpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--model", choices=sorted(SHAPES), default="resnet50")
    parser.add_argument("--scale", type=float, default=SCALE, help="parameter counts divided by this (and the caps)")
    parser.add_argument("--no-lending", action="store_true", help="gradsync copies averages back, as torch does")
    parser.add_argument("--apart", action="store_true", help="each model in a process of its own (see above)")
    parser.add_argument("--rounds", type=int, default=3, help="with --apart: how many times each process runs")
    parser.add_argument("--only", choices=NAMES, help=argparse.SUPPRESS)  # one --apart process: prints JSON
    args = parser.parse_args(argv)
    if args.no_lending:
        os.environ["GRADSYNC_LENDING"] = "0"  # read when gradsync's model is built (and by --apart's processes)
    if args.apart:
        _report(_apart(args), f"by round, {args.rounds} rounds")
        return 0
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    torch.set_num_threads(1)
    names = (args.only,) if args.only else NAMES
    models = {name: build_model(name, args.model, args.scale) for name in names}
    times = _steps(models, args.steps, args.warmup)
    if args.only:
        print(json.dumps({label: by_model[args.only] for label, by_model in times.items()}))
    else:
        _report(times, "step by step")
        print(f"bucket sizes (elements): {_bucket_sizes(models)}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
