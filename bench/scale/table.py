"""The scaling lab's results: several runs of a point merged, the points summarised, and the summary as README's
table (E(N), the step-by-step ratios, the planner's prediction, the CPU the ranks used)."""

from __future__ import annotations

import argparse
import statistics

from gradsync import planner

CPU_BUSY = 0.8  # of all cores: above this, ranks may have waited for a core


def median_of_runs(results: list[dict]) -> dict:
    """One point from several runs: each variant's median step over the runs' medians, the runs kept beside it."""
    merged = dict(results[-1], variants={})
    for name in results[0]["variants"]:
        runs = [r["variants"][name] for r in results]
        merged["variants"][name] = dict(
            runs[-1],
            median_ms=statistics.median(v["median_ms"] for v in runs),
            runs_ms=[v["median_ms"] for v in runs],
            cpu_s_per_step=max(v["cpu_s_per_step"] for v in runs),
            averages_ok=all(v["averages_ok"] for v in runs),
            paired_runs=[v.get("paired_to_torch") for v in runs],
            forward_ms=statistics.median(v["forward_ms"] for v in runs),
        )
    return merged


def medians(result: dict) -> dict:
    return {name: round(v["median_ms"], 1) for name, v in result["variants"].items()}


def summarise(args: argparse.Namespace, link: planner.Topology, points: list[dict]) -> dict:
    base = {name: points[0]["variants"][name]["median_ms"] for name in points[0]["variants"]}
    rows = []
    for p in points:
        row = {"ranks": p["ranks"], "predicted_ms": p["predicted_ms"], "cpu_busy": p["cpu_busy"]}
        row["compute_stretch"] = p.get("compute_stretch", 1.0)
        row["predicted_default_ms"] = p.get("predicted_default_ms", p["predicted_ms"])
        for name, v in p["variants"].items():
            row[f"{name}_ms"] = v["median_ms"]
            row[f"{name}_efficiency"] = base[name] / v["median_ms"]
            row[f"{name}_averages_ok"] = v["averages_ok"]
            row[f"{name}_runs_ms"] = v.get("runs_ms", [v["median_ms"]])
            row[f"{name}_paired"] = v.get("paired_runs", [v.get("paired_to_torch")])
            row[f"{name}_forward_ms"] = v.get("forward_ms")
        rows.append(row)
    return {
        "model": args.model,
        "link": args.link,
        "scale": args.scale,
        "slow_motion": args.slow_motion,
        "ranks_per_host": args.ranks_per_host,
        "probe": {"bandwidth": link.bandwidth, "latency": link.latency},
        "rows": rows,
    }


LABELS = {"torch": "torch", "gradsync": "gradsync default", "gradsync_fixed": "gradsync, torch's settings"}


def markdown(summary: dict) -> str:
    rows = summary["rows"]
    names = [n for n in ("torch", "gradsync", "gradsync_fixed") if f"{n}_ms" in rows[0]]
    lines = [
        "| | " + " | ".join(f"N = {r['ranks']}" for r in rows) + " |",
        "|---|" + "---:|" * len(rows),
    ]
    for n in names:
        cells = [f"{r[f'{n}_ms']:.0f} ({r[f'{n}_efficiency']:.3f})" for r in rows]
        runs = max(len(r.get(f"{n}_runs_ms", [])) for r in rows)
        lines.append(f"| {LABELS[n]} ms (E){f', median of {runs}' if runs > 1 else ''} | " + " | ".join(cells) + " |")
    for n in names[1:] if names[0] == "torch" else ():
        cells = [_paired(r[f"{n}_paired"]) for r in rows]
        lines.append(f"| {LABELS[n]} / torch, step by step | " + " | ".join(cells) + " |")
    for n in names[1:] if names[0] == "torch" else ():
        cells = ["1"] + [efficiency_ratio(rows[0][f"{n}_paired"], r[f"{n}_paired"]) for r in rows[1:]]
        lines.append(f"| {LABELS[n]} E / torch's E, from the steps | " + " | ".join(cells) + " |")
    # The planner prices torch's bucket caps: set it beside the runs with those settings.
    same = "gradsync_fixed" if "gradsync_fixed" in names else "gradsync"
    predicted = [f"{r['predicted_ms']:.0f} ({r['predicted_ms'] / r[f'{same}_ms']:.2f})" for r in rows]
    lines.append(f"| predicted ms (/ {LABELS[same]}) | " + " | ".join(predicted) + " |")
    if same != "gradsync":
        default = [
            f"{r['predicted_default_ms']:.0f} ({r['predicted_default_ms'] / r['gradsync_ms']:.2f})" for r in rows
        ]
        lines.append("| predicted ms with the tuner's caps (/ gradsync default) | " + " | ".join(default) + " |")
    busy = [f"{r['cpu_busy']:.0%}{', saturated' if r['cpu_busy'] > CPU_BUSY else ''}" for r in rows]
    lines.append("| CPU busy | " + " | ".join(busy) + " |")
    stretch = [f"{r.get('compute_stretch', 1.0):.2f}" for r in rows]
    lines.append("| compute stretch (forward vs N = 1) | " + " | ".join(stretch) + " |")
    ok = all(r.get(f"{n}_averages_ok", True) for r in rows for n in names)
    lines.append(f"\nGradients equal to the exact average on every rank at every point: {'yes' if ok else 'NO'}.")
    return "\n".join(lines)


def efficiency_ratio(one: list[float | None], many: list[float | None]) -> str:
    """E(N) over torch's E(N), from the step-by-step ratios r (gradsync / torch, same round): E = step(1) / step(N),
    so the ratio is r(1) / r(N), free of the drift between separate medians. The range pairs the extremes."""
    ones, manys = sorted(r for r in one if r is not None), sorted(r for r in many if r is not None)
    if not ones or not manys:
        return "-"
    middle = statistics.median(ones) / statistics.median(manys)
    low, high = ones[0] / manys[-1], ones[-1] / manys[0]
    return f"{middle:.3f}" + (f" ({low:.3f}-{high:.3f})" if low != high else "")


def _paired(ratios: list[float | None]) -> str:
    """The median over runs of each run's median paired ratio, with the runs' range when there are several."""
    found = sorted(r for r in ratios if r is not None)
    if not found:
        return "-"
    middle = statistics.median(found)
    return f"{middle:.3f}" + (f" ({found[0]:.3f}-{found[-1]:.3f})" if len(found) > 1 else "")
