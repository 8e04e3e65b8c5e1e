"""One rank of the scaling lab (bench/scale/): torch's DDP and gradsync's default, each on its own synthetic
model, one step of each in turn; rank 0 writes the per-step times, every rank's CPU use, and the averages check.

Started with RANK/WORLD_SIZE/MASTER_* set, inside a netlab namespace (several ranks per namespace share its link).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

import gradsync
from gradsync.reducer import autotune, buckets
from lab.results import write_json
from lab.zoo.synthetic import SyntheticModel

SAME_SETTINGS = "gradsync_fixed"  # gradsync at torch's settings (its caps, no tuning); "gradsync" is the default
VARIANTS = f"torch,gradsync,{SAME_SETTINGS}"


def _variants(args: argparse.Namespace, rank: int) -> dict:
    out = {}
    for name in args.variants.split(","):
        torch.manual_seed(0)
        model = SyntheticModel(args.model, scale=args.scale, layers=args.layers, time_scale=args.time_scale)
        model.value = float(rank + 1)  # the average of 1..N is known: (N + 1) / 2
        if name == "torch":
            out[name] = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb_list=torch_caps(args.scale))
        elif name == SAME_SETTINGS:  # torch's bucket layout, no tuner: the same settings as torch's DDP
            out[name] = gradsync.DistributedDataParallel(model, bucket_cap_mb_list=torch_caps(args.scale))
        else:  # what a user gets: torch's caps in iteration 1, then the tuner's choice once measured faster
            out[name] = gradsync.DistributedDataParallel(model)
    return out


def torch_caps(scale: float) -> list[float]:
    """torch's default caps (a 1 MiB first bucket, then 25 MiB) divided like the bytes, so that the scaled model
    has as many buckets as the real one: unscaled, ResNet-50/64 would fit in two and overlap far less."""
    return [1.0 / scale, 25.0 / scale]


def scale_tuner_bytes(scale: float) -> None:
    """Divide the byte sizes gradsync's default starts from and chooses among (torch's 1 + 25 MiB caps, the tuner's
    candidate caps) like the model's bytes, so that the default variant faces the choice a user of the real model
    on the real link faces. Unscaled, the tuner would start from two buckets for the whole scaled model and measure
    its proposal against those, not against torch's caps as the lab runs them.

    The tuner's probe sizes stay unscaled (1 MiB here, the gradients' size at most): tbf lets its burst (125 kB)
    through at once, which a real link does not, so a scaled-down probe would read the link far too fast."""
    buckets.DEFAULT_FIRST_BUCKET_BYTES = max(1, int(buckets.DEFAULT_FIRST_BUCKET_BYTES / scale))
    buckets.DEFAULT_BUCKET_CAP_MB = buckets.DEFAULT_BUCKET_CAP_MB / scale
    autotune.CANDIDATE_CAPS_MB = tuple(cap / scale for cap in autotune.CANDIDATE_CAPS_MB)


def _limits(ddp: torch.nn.Module, scale: float) -> list[int]:
    """The bucket caps (bytes: first bucket, the others) a variant ended with."""
    tuning = getattr(getattr(ddp, "reducer", None), "tuning", None)
    if tuning is not None:
        return list(tuning.size_limits)
    return [int(cap * 2**20) for cap in torch_caps(scale)]


def _step(ddp: torch.nn.Module, x: torch.Tensor) -> tuple[float, float, float]:
    """Wall and CPU seconds of one step (forward, backward with its averaging), and the forward's wall seconds
    alone (no communication: how much the shared cores stretched the prescribed compute at this N)."""
    ddp.zero_grad(set_to_none=True)  # untimed; each step's gradients are then its own average, checked at the end
    wall, cpu = time.perf_counter(), time.process_time()
    loss = ddp(x)
    forward = time.perf_counter() - wall
    loss.backward()
    return time.perf_counter() - wall, time.process_time() - cpu, forward


def main() -> None:
    parser = argparse.ArgumentParser()
    for name, kind, default in (
        ("--model", str, "resnet50"),
        ("--scale", float, 64.0),
        ("--layers", int, 24),
        ("--time-scale", float, 1.0),
        ("--steps", int, 12),
        ("--warmup", int, 14),
        ("--variants", str, VARIANTS),
        ("--out", str, ""),
    ):
        parser.add_argument(name, type=kind, default=default)
    args = parser.parse_args()
    info = gradsync.init(timeout=300)
    torch.set_num_threads(1)
    scale_tuner_bytes(args.scale)  # only the default variant reads them: the others pass torch's caps, scaled
    variants = _variants(args, info.rank)
    times: dict[str, list[tuple[float, float, float]]] = {name: [] for name in variants}
    x = torch.ones(1, requires_grad=True)
    for i in range(args.warmup + args.steps):
        names = list(variants)[i % len(variants) :] + list(variants)[: i % len(variants)]
        for name in names:
            dist.barrier()
            t = _step(variants[name], x)
            if i >= args.warmup:
                times[name].append(t)
    expected = (info.world_size + 1) / 2
    ok = {
        n: all(torch.allclose(p.grad, torch.full_like(p.grad, expected)) for p in d.module.params)
        for n, d in variants.items()
    }
    everyone = [None] * info.world_size
    dist.all_gather_object(everyone, {"times": times, "averages_ok": ok, "host": os.uname().nodename})
    if info.rank == 0:
        write_json(args.out, _summary(args, everyone, variants))
    gradsync.shutdown()


def _summary(args: argparse.Namespace, everyone: list, variants: dict) -> dict:
    result = {"model": args.model, "ranks": len(everyone), "scale": args.scale, "variants": {}}
    # A step is as slow as its slowest rank.
    slowest = {name: [max(r["times"][name][k][0] for r in everyone) for k in range(args.steps)] for name in variants}
    for name, ddp in variants.items():
        steps = slowest[name]
        cpu = [sum(r["times"][name][k][1] for r in everyone) for k in range(args.steps)]
        tuning = getattr(getattr(ddp, "reducer", None), "tuning", None)
        result["variants"][name] = {
            "median_ms": statistics.median(steps) * 1e3,
            "steps_ms": [s * 1e3 for s in steps],
            "cpu_s_per_step": statistics.median(cpu),  # all ranks together
            "forward_ms": statistics.median(r["times"][name][k][2] for r in everyone for k in range(args.steps)) * 1e3,
            "averages_ok": all(r["averages_ok"][name] for r in everyone),
            "tuning": tuning.describe() if tuning is not None else None,
            "limits": _limits(ddp, args.scale),
            # Steps k of every variant ran in the same round, one after the other: their ratio cancels the machine's
            # drift (other tenants, thermal) that separate medians keep.
            "paired_to_torch": statistics.median(a / b for a, b in zip(steps, slowest["torch"]))
            if "torch" in slowest
            else None,
        }
    result["grad_bytes"] = next(iter(variants.values())).module.grad_bytes
    return result


if __name__ == "__main__":
    main()
