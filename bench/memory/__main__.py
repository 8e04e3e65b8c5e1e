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
import statistics
import sys
from collections.abc import Sequence

from bench.memory.worker import rank_memory
from gradsync.testing import spawn
from lab.results import write_json


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
            runs[impl].append(spawn(rank_memory, 2, args=(impl, args.params, args.steps), timeout=900)[0])
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
