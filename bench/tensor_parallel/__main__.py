"""``python -m bench.tensor_parallel``: DP x TP step time and construction memory, torch's DDP against gradsync's,
on a ("dp", "tp") mesh of 4 ranks: two lab hosts of two ranks each, tp inside a host, dp across a link shaped to
``--link`` (lab/netlab.py; needs root), or all 4 on loopback with ``--link loopback``.

    python -m bench.tensor_parallel --link 1gbit --runs 3

The link bound is the time the averaged gradients take on the link: each data-parallel rank of 2 sends its local
shards' bytes once (ring all-reduce: 2 (n - 1) / n of them). CPU headroom: the 2 cores' busy fraction over the
timed steps, all 4 ranks together.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from gradsync.testing import free_port
from lab.ranks_on_hosts import run_ranks
from lab.results import read_json, write_json

RATES = {"1gbit": 1e9, "100mbit": 1e8, "10gbit": 1e10}


def _one_run(args, out: Path) -> dict:
    argv = [sys.executable, "-m", "bench.tensor_parallel.worker", "--out", str(out), "--steps", str(args.steps)]
    argv += ["--dim", str(args.dim), "--layers", str(args.layers), "--tokens", str(args.tokens)]
    run_ranks(argv, 2, 2, args.link, args.port, args.timeout, "bench.tensor_parallel")
    return read_json(out)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tensor_parallel", description=__doc__)
    parser.add_argument("--link", default="1gbit", help="loopback, or a tc rate such as 1gbit")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--port", type=int, default=0, help="the rendezvous port; 0: a free one")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--out", default="bench/results/tensor-parallel.json")
    args = parser.parse_args()
    args.port = args.port or free_port()
    out = Path(args.out)
    runs = [_one_run(args, out.with_suffix(f".run{k}.json")) for k in range(args.runs)]
    names = list(runs[0]["median_ms"])
    # Both tensor-parallel ranks of a host average their shards with the other host's: the link carries both.
    host_bytes = 2 * runs[0]["averaged_mib_per_dp_rank"] * 2**20
    bound_ms = 1e3 * host_bytes * 8 / RATES[args.link] if args.link in RATES else None
    summary = {
        "link": args.link,
        "runs": runs,
        "ratio_vs_torch": {k: statistics.median(r["ratio_vs_torch"][k] for r in runs) for k in names},
        "median_ms": {k: statistics.median(r["median_ms"][k] for r in runs) for k in names},
        "bucket_mib": runs[0]["bucket_mib"],
        "link_bound_ms": bound_ms,
        "cpu_busy_of_2_cores": statistics.median(r["cpu_busy_cores_all_ranks"] for r in runs) / 2,
    }
    write_json(out, summary)
    for k in range(args.runs):
        out.with_suffix(f".run{k}.json").unlink()
    for k in names:
        print(f"{k:<18} {summary['median_ms'][k]:7.1f} ms  x{summary['ratio_vs_torch'][k]:.3f} torch", end="  ")
        print(f"{summary['median_ms'][k] / bound_ms:.2f} x link bound" if bound_ms else "", end="  ")
        print(f"buckets MiB {[round(b, 1) for b in summary['bucket_mib'][k]]}")
    print(f"{args.link}, median of {args.runs} runs; link bound {bound_ms or 0:.1f} ms", end="; ")
    print(f"CPU busy {100 * summary['cpu_busy_of_2_cores']:.0f}% of 2 cores")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
