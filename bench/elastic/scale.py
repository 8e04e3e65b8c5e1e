"""``python -m bench.elastic.scale``: recovery against the job's size. The chaos lab (lab/chaos.py) at each number of
ranks (hosts of 1 rank, network namespaces), faults of one kind only, then a model of how the pause and the rejoin
grow, fitted on the smaller sizes and checked against the largest before it says anything about 256:

    python -m bench.elastic.scale --ranks 4 8 16 --runs 2 --kind sigkill

Per size: the survivors' pause after each fault (the longest wait between two committed steps of the job) and the
time until the victim's host commits again, as medians over every fault of every run, and the CPU the runs used (2
cores here: the workers' prescribed steps sleep, so a figure at 16 ranks is not a saturated machine's unless the CPU
says so). The models are ``a + b N`` and ``a + b log2 N``; the one whose prediction of the largest size was closer
is extrapolated. Writes ``bench/results/elastic-scale.json``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from bench.elastic.chaos import back_after, children_cpu, summarize
from lab import chaos, netlab
from lab.elastic import events_of
from lab.results import write_json

MODELS: dict[str, Callable[[float], float]] = {"a + b N": lambda n: n, "a + b log2 N": math.log2}


def fit(points: dict[int, float], feature: Callable[[float], float]) -> tuple[float, float]:
    """Least squares ``y = a + b feature(n)`` through ``points`` {n: y}; returns (a, b).

    >>> fit({4: 1.0, 8: 2.0}, lambda n: n)
    (0.0, 0.25)
    """
    xs, ys = [feature(n) for n in points], list(points.values())
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def check_models(measured: dict[int, float], target: int = 256) -> dict:
    """Each model fitted on every size but the largest, its error there, and the closer one refitted on all sizes
    and extrapolated to ``target`` ranks."""
    *small, largest = sorted(measured)
    checked = {}
    for name, feature in MODELS.items():
        a, b = fit({n: measured[n] for n in small}, feature)
        checked[name] = {
            "predicted at largest": a + b * feature(largest),
            "error s": a + b * feature(largest) - measured[largest],
        }
    best = min(checked, key=lambda name: abs(checked[name]["error s"]))
    a, b = fit(measured, MODELS[best])
    return {"models": checked, "chosen": best, "a": a, "b": b, f"at {target} ranks s": a + b * MODELS[best](target)}


def measure(ranks: int, runs: int, kind: str, budget_s: float, mean_s: float) -> dict:
    pauses, backs, faults, cpu, wall = [], [], 0, 0.0, 0.0
    for run in range(runs):
        began, cpu_before = time.monotonic(), children_cpu()
        result = chaos.run(Path(tempfile.mkdtemp(prefix="gsscale")), ranks, budget_s, mean_s, seed=run, kinds=[kind])
        summary = summarize(result, children_cpu() - cpu_before, time.monotonic() - began)
        pauses += [p["pause s"] for p in summary["pauses"]]
        events, host_of = events_of(result.out), {int(p.stem): p.read_text() for p in result.out.glob("*.pid")}
        backs += [back_after(events, host_of, fault) for fault in result.faults]
        faults += len(result.faults)
        cpu, wall = cpu + summary["cpu used"] * summary["wall s"], wall + summary["wall s"]
    return {
        "ranks": ranks,
        "faults": faults,
        "pause p50 s": statistics.median(pauses),
        "pause max s": max(pauses),
        "back median s": statistics.median(backs),
        "cpu used": cpu / wall,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.elastic.scale", description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--kind", choices=chaos.KINDS, default="sigkill")
    parser.add_argument("--budget", type=float, default=40.0, help="seconds of faults per run")
    parser.add_argument("--mean", type=float, default=8.0, help="mean seconds between faults")
    parser.add_argument("--results", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    if netlab.available() is not None:
        print(f"skipped: {netlab.available()}")
        return 1
    rows = [measure(n, args.runs, args.kind, args.budget, args.mean) for n in args.ranks]
    summary = {
        "kind": args.kind,
        "sizes": rows,
        "pause model": check_models({r["ranks"]: r["pause p50 s"] for r in rows}),
        "rejoin model": check_models({r["ranks"]: r["back median s"] for r in rows}),
    }
    args.results.mkdir(parents=True, exist_ok=True)
    write_json(args.results / "elastic-scale.json", summary)
    print(report(summary))
    return 0


def report(summary: dict) -> str:
    lines = [f"{'ranks':>5s} {'faults':>6s} {'pause p50':>9s} {'pause max':>9s} {'back':>6s} {'CPU':>5s}"]
    for r in summary["sizes"]:
        lines.append(
            f"{r['ranks']:5d} {r['faults']:6d} {r['pause p50 s']:9.2f} {r['pause max s']:9.2f} "
            f"{r['back median s']:6.2f} {r['cpu used']:5.0%}"
        )
    for what in ("pause model", "rejoin model"):
        m = summary[what]
        errors = ", ".join(f"{name}: {v['error s']:+.2f} s" for name, v in m["models"].items())
        lines.append(
            f"{what}: error at the largest size ({errors}); {m['chosen']}: a={m['a']:.3f}, b={m['b']:.4f}, "
            f"at 256 ranks {m['at 256 ranks s']:.2f} s"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
