"""``python -m bench.scale.paper_plan``: what ``gradsync plan`` predicts for the DDP paper's setting, with the inputs
assumed (Li et al., VLDB 2020, report near-linear scaling of ResNet-50 and BERT to 256 GPUs with NCCL).

Assumed, not measured here: 256 V100 as 32 hosts x 8 GPUs; NVLink inside a host (50 GB/s per GPU, 5 us per hop);
100 Gbit/s between hosts (25 us per hop); NCCL's hierarchical all-reduce; fp32 gradients in 25 MiB buckets; per-GPU
compute as in lab/zoo/synthetic.py's ``PROFILES_S`` (the paper's per-GPU batch sizes), split across layers by
multiply-adds, backward twice forward. The timeline is the synthetic model's at full size (no scaling).
"""

from __future__ import annotations

import sys

from gradsync import planner
from lab.zoo.synthetic import SyntheticModel

RANKS_PER_HOST = 8


def timeline(model: str) -> planner.Timeline:
    synthetic = SyntheticModel(model, scale=1.0, layers=48)
    layers, start = [], 0
    for layer in synthetic.layers:
        nbytes = sum(synthetic.params[i].numel() * 4 for i in range(start, start + len(layer.names)))
        layers.append((nbytes, layer.forward_s, layer.backward_s))
        start += len(layer.names)
    return planner.timeline_from_profile(layers)


def main() -> int:
    print("| model | ranks | hosts x GPUs | predicted step ms | efficiency | best cap MiB | bf16 ms |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for model in ("resnet50", "bert"):
        steps = timeline(model)
        for hosts in (1, 4, 16, 32):
            topology = planner.Topology(
                hosts,
                RANKS_PER_HOST,
                planner.parse_rate("100gbit"),
                25e-6,
                planner.parse_rate("50GB"),
                5e-6,
                hierarchical=True,
            )
            p = planner.plan(steps, topology)
            print(
                f"| {model} | {p.ranks} | {hosts} x {RANKS_PER_HOST} | {p.step_s * 1e3:.1f} | {p.efficiency:.3f} | "
                f"{p.cap_mb:g} | {p.options['bf16 compression'] * 1e3:.1f} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
