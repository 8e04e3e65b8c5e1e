"""``python -m bench.mixed_precision``: ``mixed_precision=`` against autocast over fp32 parameters and against fp32,
on the bench's GPT (lab/zoo/workloads.py's TinyGPT, 3.5 M parameters) at CPU bf16, 2 gloo ranks.

    python -m bench.mixed_precision --runs 3 --loss-runs 1

Three figures, the first two over ``--runs`` runs, the third over ``--loss-runs`` (medians; bf16 matrix products
are slow on a CPU without bf16 instructions, so a loss run takes minutes):

- **step time**: the three variants in the same two processes, steps interleaved (bench/interleave.py: each round
  runs every variant once after a barrier, the order reversed every other round), AdamW, batch 8 x 64 tokens a rank;
- **peak memory**: each variant alone in two fresh processes, the growth of each rank's peak resident memory from
  before the model is built to after 3 steps (``MALLOC_MMAP_THRESHOLD_`` pinned, as in ``python -m bench.memory``);
- **loss after ``--steps`` steps** of next-token prediction on a learnable synthetic sequence task, the mean of the
  last 10 steps' losses: mixed precision and autocast against fp32, beside two fp32 runs with different seeds (the
  noise the difference is judged against).

torch's DDP with the same ``_MixedPrecision`` is not in the CPU figures: on CPU it records CUDA events
(tests/test_mixed_precision.py's docstring); tests/gpu/bench.py compares them on a GPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Sequence

from bench.mixed_precision.worker import VARIANTS, rank_losses, rank_memory, rank_times
from gradsync.testing import spawn
from lab.results import write_json

WORLD = 2


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.mixed_precision", description=__doc__)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--timed", type=int, default=8, help="interleaved steps timed a run")
    parser.add_argument("--steps", type=int, default=30, help="training steps for the loss figure")
    parser.add_argument("--loss-runs", type=int, default=1, help="runs of the loss figure (seeds 0, 1, ...)")
    parser.add_argument("--out", default="bench/results/mixed_precision.json")
    args = parser.parse_args(argv)
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # read by glibc when each rank starts
    results: dict[str, object] = {"runs": args.runs, "world": WORLD}
    times = [spawn(rank_times, WORLD, args=(args.timed,), timeout=900)[0] for _ in range(args.runs)]
    results["step_ms"] = {v: statistics.median(t["ms"][v] for t in times) for v in VARIANTS}
    results["step_ratio_to_fp32"] = {v: statistics.median(t["ratio"][v] for t in times) for v in VARIANTS}
    results["cores_busy"] = statistics.median(t["busy"] for t in times)
    memory = {v: [max(spawn(rank_memory, WORLD, args=(v,), timeout=300)) for _ in range(args.runs)] for v in VARIANTS}
    results["peak_rss_growth_mib"] = {v: statistics.median(m) for v, m in memory.items()}
    losses = [spawn(rank_losses, WORLD, args=(args.steps, run), timeout=1800)[0] for run in range(args.loss_runs)]
    results["final_loss"] = {k: statistics.median(run[k] for run in losses) for k in losses[0]}
    results["loss_gap"] = {
        k: statistics.median(abs(run[k] - run["fp32"]) for run in losses) for k in losses[0] if k != "fp32"
    }
    write_json(args.out, results)
    _print(results)
    return 0


def _print(results: dict) -> None:
    print(f"{'variant':<10} {'step ms':>9} {'x fp32':>7} {'peak RSS growth MiB':>20} {'final loss':>11}")
    for v in VARIANTS:
        print(
            f"{v:<10} {results['step_ms'][v]:9.1f} {results['step_ratio_to_fp32'][v]:7.2f} "
            f"{results['peak_rss_growth_mib'][v]:20.1f} {results['final_loss'][v]:11.4f}"
        )
    gaps = results["loss_gap"]
    print(f"loss gap to fp32 (seed 0): {', '.join(f'{k} {v:.4f}' for k, v in gaps.items())}")
    print(f"cores busy while timing: {results['cores_busy']:.2f} of {os.cpu_count()}")


if __name__ == "__main__":
    sys.exit(main())
