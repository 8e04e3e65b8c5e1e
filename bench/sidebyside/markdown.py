"""``python -m bench.sidebyside.markdown bench/results/*.json``: the results as markdown tables (for README.md)."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def table(result: dict) -> str:
    bound = result.get("overlap_bound_ms")
    head = f"**{result['model']}**, {result['link']}, batch {result['batch']}/rank, {result['steps']} steps"
    head += f"; overlap bound {bound:.0f} ms" if bound else ""
    rows = [
        head,
        "",
        "| variant | median step ms | × torch (paired) | × bound | MiB sent/step | optim state MiB |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for spec, v in result["variants"].items():
        ratio = v.get("ratio_vs_torch")
        vs_torch = f"{ratio:.3f}" if ratio else "-"
        vs_bound = f"{v['median_ms'] / bound:.2f}" if bound else "-"
        rows.append(
            f"| `{spec}` | {v['median_ms']:.1f} | {vs_torch} | {vs_bound} | {v['wire_bytes'] / 2**20:.1f} | "
            f"{v.get('optimizer_state_bytes', 0) / 2**20:.1f} |"
        )
    return "\n".join(rows)


def main(paths: list[str]) -> None:
    for path in paths:
        print(table(json.loads(Path(path).read_text())))
        print()


if __name__ == "__main__":
    main(sys.argv[1:])
