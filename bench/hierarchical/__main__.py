"""``python -m bench.hierarchical``: the two-level all-reduce (gradsync/comm/hierarchical.py) against torch's flat
one, on ``--hosts`` lab hosts of ``--ranks-per-host`` ranks, the hosts' links shaped to ``--link`` (needs root).

    python -m bench.hierarchical --hosts 2 --ranks-per-host 2 --link 1gbit --runs 3

Each row's bound is the step's physical limit measured in the same run: max(the model's step alone, on no
network, and the bytes each host's link must carry at the link's rate). A flat ring makes each host's link carry
2 (N - 1) / N of the gradients; the two-level all-reduce 2 (H - 1) / H, the least any all-reduce can.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from gradsync.testing import free_port
from lab.ranks_on_hosts import run_ranks
from lab.results import read_json, write_json

RATES = {"100mbit": 1e8, "1gbit": 1e9, "10gbit": 1e10}


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.hierarchical", description=__doc__)
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--ranks-per-host", type=int, default=2)
    parser.add_argument("--link", default="1gbit", help="a tc rate such as 1gbit, or loopback")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--piece-kib", type=int, default=4096, help="the two-level pipeline's piece")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--out", default="bench/results/hierarchical.json")
    args = parser.parse_args()
    out = Path(args.out)
    argv = [sys.executable, "-m", "bench.hierarchical.worker", "--steps", str(args.steps)]
    argv += ["--width", str(args.width), "--layers", str(args.layers), "--piece-kib", str(args.piece_kib)]
    runs = []
    for k in range(args.runs):
        one = out.with_suffix(f".run{k}.json")
        run_ranks(
            argv + ["--out", str(one)],
            args.hosts,
            args.ranks_per_host,
            args.link,
            free_port(),
            args.timeout,
            "bench.hierarchical",
        )
        runs.append(read_json(one))
        one.unlink()
    names = list(runs[0]["median_ms"])
    median_ms = {n: statistics.median(r["median_ms"][n] for r in runs) for n in names}
    world, hosts = args.hosts * args.ranks_per_host, args.hosts
    mib = runs[0]["gradient_mib"]
    rate = RATES.get(args.link)
    wire_ms = {
        "flat": 1e3 * mib * 2**20 * 8 * 2 * (world - 1) / world / rate if rate else 0.0,
        "least": 1e3 * mib * 2**20 * 8 * 2 * (hosts - 1) / hosts / rate if rate else 0.0,
    }
    bound_ms = max(median_ms["local"], wire_ms["least"])
    summary = {
        "link": args.link,
        "hosts": args.hosts,
        "ranks_per_host": args.ranks_per_host,
        "gradient_mib": mib,
        "piece_kib": args.piece_kib,
        "median_ms": median_ms,
        "ratio_vs_torch": {n: statistics.median(r["ratio_vs_torch"][n] for r in runs) for n in names},
        "host_link_ms": wire_ms,
        "bound_ms": bound_ms,
        "multiple_of_bound": {n: median_ms[n] / bound_ms for n in names},
        "cpu_busy_of_2_cores": statistics.median(r["cpu_busy_cores_all_ranks"] for r in runs) / 2,
        "max_param_diff_vs_torch": max(r["hierarchical_vs_torch_max_param_diff"] for r in runs),
        "runs": runs,
    }
    write_json(out, summary)
    ratio, multiple = summary["ratio_vs_torch"], summary["multiple_of_bound"]
    for n in names:
        print(f"{n:<22} {median_ms[n]:8.1f} ms  x{ratio[n]:.3f} torch  {multiple[n]:.2f} x bound")
    print(f"bound {bound_ms:.1f} ms: model alone {median_ms['local']:.1f} ms", end="; ")
    print(f"host link, flat {wire_ms['flat']:.1f} ms, least {wire_ms['least']:.1f} ms")
    print(f"CPU busy {100 * summary['cpu_busy_of_2_cores']:.0f}% of 2 cores", end="; ")
    print(f"two-level vs torch, parameters' max difference {summary['max_param_diff_vs_torch']:.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
