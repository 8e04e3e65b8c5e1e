"""One rank of a benchmark: every variant lives in this process and shares its process group; steps are
interleaved (variant order rotating each round) so machine drift hits all variants alike. Rank 0 writes JSON.

Started by ``python -m bench`` (directly, or inside a netlab namespace) with RANK/WORLD_SIZE/MASTER_* set.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist

import gradsync
from bench.sidebyside.variants import build
from lab.results import write_json
from lab.zoo.workloads import make


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else 0.0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--variants", required=True, help="comma-separated specs; ';' separates options sets")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--out", required=True)
    parser.add_argument("--compile", choices=("outer", "inner"), default=None)
    parser.add_argument("--backend", default="inductor")
    args = parser.parse_args()

    info = gradsync.init(timeout=300)
    torch.set_num_threads(1)
    specs = args.variants.split(";")
    variants = [build(spec, args.model, compile_order=args.compile, backend=args.backend) for spec in specs]
    _, batch_fn = make(args.model)
    gen = torch.Generator().manual_seed(1234 + info.rank)
    batches = [batch_fn(args.batch, gen) for _ in range(4)]
    times: dict[str, list[dict[str, float]]] = {v.spec: [] for v in variants}
    for i in range(args.warmup + args.steps):
        order = variants[i % len(variants) :] + variants[: i % len(variants)]
        for v in order:
            inputs, loss_fn = batches[i % len(batches)]
            dist.barrier()  # every variant's step starts with the ranks aligned
            t = v.step(inputs, loss_fn)
            if i >= args.warmup:
                times[v.spec].append(t)
    # A step is as slow as its slowest rank.
    for steps in times.values():
        for key in ("total", "forward", "backward", "allreduce", "optimizer"):
            vals = torch.tensor([s[key] for s in steps], dtype=torch.float64)
            dist.all_reduce(vals, op=dist.ReduceOp.MAX)
            for s, v in zip(steps, vals.tolist()):
                s[key] = v
    if info.rank == 0:
        result = summarize(args, variants, times)
        write_json(args.out, result)
    gradsync.shutdown()


def summarize(args, variants, times) -> dict:
    ref = next((v.spec for v in variants if v.spec == "torch"), None) or next(
        (v.spec for v in variants if v.spec.startswith("torch")), None
    )
    out = {
        "model": args.model,
        "batch": args.batch,
        "steps": args.steps,
        "world_size": dist.get_world_size(),
        "reference": ref,  # the torch variant every ratio_vs_torch is paired against
        "compile": args.compile,
        "backend": args.backend if args.compile else None,
        "variants": {},
    }
    for v in variants:
        totals = [s["total"] for s in times[v.spec]]
        entry = {
            "median_ms": _median(totals) * 1e3,
            "steps_ms": [t * 1e3 for t in totals],
            "grad_bytes": v.grad_bytes,
            "wire_bytes": v.wire_bytes(),
            "grad_storage_bytes": v.memory(),
            "optimizer_state_bytes": v.optimizer_state(),
            "bucket_tuning": v.tuning(),
            "graph_split": v.graph_split(),
        }
        for key in ("forward", "backward", "allreduce", "optimizer"):
            entry[f"{key}_ms"] = _median([s[key] for s in times[v.spec]]) * 1e3
        if ref is not None:
            paired = [a / b for a, b in zip(totals, [s["total"] for s in times[ref]])]
            entry["ratio_vs_torch"] = _median(paired)
        out["variants"][v.spec] = entry
    local = out["variants"].get("local")
    ar = out["variants"].get("allreduce")
    if local:
        # Communication that backward did not hide: a DDP variant's backward beyond the same backward alone.
        for spec, entry in out["variants"].items():
            if spec.startswith(("torch", "gradsync")):
                entry["exposed_comm_ms"] = max(entry["backward_ms"] - local["backward_ms"], 0.0)
    if local and ar:
        # The best overlap can do: forward, then backward and all-reduce side by side (the definition).
        out["overlap_bound_ms"] = local["forward_ms"] + max(local["backward_ms"], ar["allreduce_ms"])
        # The physical limit, measured in this run: no step is shorter than the model's step alone or than the
        # all-reduce of every gradient alone on this link.
        out["limit_ms"] = max(local["median_ms"], ar["allreduce_ms"])
        for entry in out["variants"].values():
            entry["x_limit"] = entry["median_ms"] / out["limit_ms"]
    return out


if __name__ == "__main__":
    main()
