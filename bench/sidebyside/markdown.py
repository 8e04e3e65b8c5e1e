"""``python -m bench.sidebyside.markdown bench/results/*.json``: the results as markdown tables (for README.md)."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def table(result: dict) -> str:
    bound = result.get("overlap_bound_ms")
    head = f"**{result['model']}**, {result['link']}, batch {result['batch']}/rank, {result['steps']} steps"
    head += f"; overlap bound {bound:.0f} ms" if bound else ""
    head += f"; limit {result['limit_ms']:.0f} ms" if result.get("limit_ms") else ""
    rows = [
        head,
        "",
        "| variant | median step ms | × torch (paired) | × bound | × limit | MiB sent/step | optim state MiB |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for spec, v in result["variants"].items():
        ratio = v.get("ratio_vs_torch")
        vs_torch = f"{ratio:.3f}" if ratio else "-"
        vs_bound = f"{v['median_ms'] / bound:.2f}" if bound else "-"
        rows.append(
            f"| `{spec}` | {v['median_ms']:.1f} | {vs_torch} | {vs_bound} | {_limit(v)} | "
            f"{v['wire_bytes'] / 2**20:.1f} | {v.get('optimizer_state_bytes', 0) / 2**20:.1f} |"
        )
    return "\n".join(rows)


def _limit(variant: dict) -> str:
    """The step as a multiple of the physical limit (max of the model alone and the all-reduce alone), if measured."""
    return f"{variant['x_limit']:.2f}" if "x_limit" in variant else "-"


def main(paths: list[str]) -> None:
    for path in paths:
        print(table(json.loads(Path(path).read_text())))
        print()


if __name__ == "__main__":
    main(sys.argv[1:])
