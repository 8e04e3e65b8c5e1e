"""``python -m bench.sidebyside.repeat``: the same side-by-side benchmark several times, for figures that hold
beyond one run.

    python -m bench.sidebyside.repeat --runs 3 --models mlp,gpt --links loopback,1gbit \\
        --variants "torch;gradsync:tune=0;gradsync" --out bench/results/tuner

Each (model, link, run) is one ``python -m bench`` run (steps interleaved inside it) and keeps its JSON. The
summary gives, per model and link, the median over runs of each variant's paired ratio against torch's DDP and of
gradsync's default against gradsync with the same settings as torch (``gradsync:tune=0``), with each run's value
and the tuner's decisions, so the spread is visible too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace

from bench.sidebyside.runner import add_compile_arguments, run
from gradsync.reducer.rebuild import TRIAL_PAIRS
from lab.results import write_json

SAME, DEFAULT = "gradsync:tune=0", "gradsync"


def paired(result: dict, spec: str, reference: str) -> float | None:
    """Median of per-step ratios ``spec / reference`` within one run (steps were interleaved)."""
    variants = result["variants"]
    if spec not in variants or reference not in variants:
        return None
    pairs = zip(variants[spec]["steps_ms"], variants[reference]["steps_ms"])
    return statistics.median(a / b for a, b in pairs)


def summarize(results: list[dict]) -> dict:
    """Per variant: each run's ratio against torch; and default against same settings, each run and median."""
    specs = list(results[0]["variants"])
    out: dict = {"model": results[0]["model"], "link": results[0]["link"], "runs": len(results), "variants": {}}
    out["compile"] = results[0].get("compile")
    for spec in specs:
        ratios = [r["variants"][spec].get("ratio_vs_torch") for r in results]
        tunings = [r["variants"][spec].get("bucket_tuning") for r in results]
        exposed = [r["variants"][spec].get("exposed_comm_ms") for r in results]
        limits = [r["variants"][spec].get("x_limit") for r in results]
        out["variants"][spec] = {
            "x_limit_runs": limits,
            "x_limit": statistics.median(limits) if all(x is not None for x in limits) else None,
            "vs_torch_runs": ratios,
            "vs_torch": statistics.median(x for x in ratios if x is not None) if any(ratios) else None,
            "tuning_runs": tunings,
            "exposed_comm_ms": statistics.median(exposed) if all(x is not None for x in exposed) else None,
            "graph_split_runs": [r["variants"][spec].get("graph_split") for r in results],
        }
    same = [paired(r, DEFAULT, SAME) for r in results]
    if all(x is not None for x in same):
        out["default_vs_same_runs"] = same
        out["default_vs_same"] = statistics.median(same)  # type: ignore[type-var]
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.sidebyside.repeat", description=__doc__)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--models", default="mlp,lnmlp,gpt,cnn,tiny")
    parser.add_argument("--links", default="loopback,1gbit")
    parser.add_argument("--variants", default=f"torch;{SAME};{DEFAULT}")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=4 + 2 * TRIAL_PAIRS)
    parser.add_argument("--delay", default=None)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--out", default="bench/results/repeat")
    add_compile_arguments(parser)
    args = parser.parse_args(argv)
    folder = Path(args.out)
    folder.mkdir(parents=True, exist_ok=True)
    summaries = []
    for model in args.models.split(","):
        for link in args.links.split(","):
            results = []
            for k in range(args.runs):
                out = folder / f"{model}-{link}-run{k + 1}.json"
                one = dict(vars(args), model=model, link=link, out=str(out))
                results.append(run(SimpleNamespace(**one)))
            summary = summarize(results)
            summaries.append(summary)
            print(json.dumps(summary, indent=1), flush=True)
    write_json(folder / "summary.json", {"summaries": summaries})
    print(markdown(summaries) if not args.compile else compiled_markdown(summaries))
    return 0


def markdown(summaries: list[dict]) -> str:
    """One row per model and link: medians over runs, with each run's value in brackets."""
    rows = [
        "| model | link | default × same settings | default × torch | same settings × torch "
        "| × limit: torch / default |",
        "|---|---|---|---|---|---|",
    ]
    for s in summaries:
        v = s["variants"]

        def cell(median: float | None, runs: list) -> str:
            if median is None:
                return "-"
            return f"{median:.3f} ({', '.join(f'{x:.3f}' for x in runs if x is not None)})"

        rows.append(
            f"| {s['model']} | {s['link']} | {cell(s.get('default_vs_same'), s.get('default_vs_same_runs', []))} | "
            f"{cell(v[DEFAULT]['vs_torch'], v[DEFAULT]['vs_torch_runs'])} | "
            f"{cell(v[SAME]['vs_torch'], v[SAME]['vs_torch_runs'])} | {_limits(v)} |"
        )
    return "\n".join(rows)


def _limits(variants: dict) -> str:
    """torch's and gradsync's steps as multiples of the physical limit (medians over runs), where it was measured."""
    torch_x, ours_x = variants.get("torch", {}).get("x_limit"), variants[DEFAULT].get("x_limit")
    return f"{torch_x:.2f} / {ours_x:.2f}" if torch_x and ours_x else "-"


def compiled_markdown(summaries: list[dict]) -> str:
    """``--compile``: compiled gradsync × compiled torch per model and link, and the communication each left exposed
    (its backward beyond the compiled local backward)."""
    rows = [
        "| model | link | order | gradsync × torch (runs) | exposed ms: torch / gradsync |",
        "|---|---|---|---|---|",
    ]
    for s in summaries:
        v = s["variants"]
        ours = next(spec for spec in v if spec.startswith("gradsync"))
        runs = ", ".join(f"{x:.3f}" for x in v[ours]["vs_torch_runs"] if x is not None)
        exposed = f"{v['torch']['exposed_comm_ms']:.1f} / {v[ours]['exposed_comm_ms']:.1f}"
        rows.append(f"| {s['model']} | {s['link']} | {s['compile']} | {v[ours]['vs_torch']:.3f} ({runs}) | {exposed} |")
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
