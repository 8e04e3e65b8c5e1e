"""``python -m bench.memory``: peak host memory of gradsync's DDP against torch's, side by side, on a large model.

    python -m bench.memory --runs 3 --params 201

Each (implementation, run) is 2 fresh gloo ranks training an MLP of ``--params`` million fp32 parameters: the peak
resident memory (``ru_maxrss``) each rank grows by, from the built model, when DDP is constructed, and after
``--steps`` synced steps (past the rebuild; SGD without momentum, so no optimizer state). The ratios are gradsync /
torch of the medians over runs, per rank. On a GPU the same layouts are the device's memory; this measures their
host counterpart.

glibc keeps freed blocks of up to 32 MiB in its heap once its mmap threshold has grown (and gloo's and the
steps' temporaries come and go), so peak RSS carries allocator noise of ~10% either way. ``--mmap-threshold 65536``
pins the threshold (``MALLOC_MMAP_THRESHOLD_``) for the ranks, so freed large blocks go back to the system and the
peak is the memory actually live.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
from collections.abc import Sequence

import torch
from torch import nn

import gradsync
from gradsync.testing import spawn
from lab.results import write_json


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _model(million: int) -> nn.Module:
    width = 2048
    layers = max(1, round(million * 1e6 / (width * width + width)))
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def _worker(rank: int, world: int, impl: str, million: int, steps: int) -> dict[str, float]:
    torch.manual_seed(0)
    model = _model(million)
    x = torch.randn(4, 2048)
    base = _peak_mib()
    ddp_class = gradsync.DistributedDataParallel if impl == "gradsync" else nn.parallel.DistributedDataParallel
    ddp = ddp_class(model)
    built = _peak_mib()
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    for _ in range(steps):
        opt.zero_grad(set_to_none=False)  # gradients stay allocated, as in most loops' steady state
        ddp(x).sum().backward()
        opt.step()
    trained = _peak_mib()
    params = sum(p.numel() for p in model.parameters())
    return {"construction": built - base, "after_steps": trained - base, "params_mib": params * 4 / 2**20}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.memory", description=__doc__)
    parser.add_argument("--params", type=int, default=201, help="million parameters")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--mmap-threshold", type=int, default=None, help="MALLOC_MMAP_THRESHOLD_ for the ranks")
    parser.add_argument("--out", default="bench/results/memory.json")
    args = parser.parse_args(argv)
    if args.mmap_threshold is not None:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)  # read by glibc when each rank starts
    runs: dict[str, list[dict[str, float]]] = {"torch": [], "gradsync": []}
    for _ in range(args.runs):
        for impl in runs:  # alternated, so the machine's drift hits both
            runs[impl].append(spawn(_worker, 2, args=(impl, args.params, args.steps), timeout=900)[0])
    result: dict = {"runs": runs}
    for key in ("construction", "after_steps"):
        medians = {impl: statistics.median(r[key] for r in rs) for impl, rs in runs.items()}
        result[key] = {**medians, "ratio": medians["gradsync"] / medians["torch"]}
        print(
            f"{key}: gradsync +{medians['gradsync']:.0f} MiB, torch +{medians['torch']:.0f} MiB, "
            f"ratio {result[key]['ratio']:.3f} (rank 0, median of {args.runs})"
        )
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
