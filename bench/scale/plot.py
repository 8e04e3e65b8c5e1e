"""The scaling lab's PNG: weak-scaling efficiency E(N) of torch's DDP and gradsync's, with the planner's
prediction; the step time against N; and gradsync's step broken down into forward, backward compute and the
communication backward did not hide."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot(summary: dict, out: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = summary["rows"]
    ranks = [r["ranks"] for r in rows]
    fig, (eff, step, parts) = plt.subplots(1, 3, figsize=(15, 4.2))
    for name, style in (("torch", "o-"), ("gradsync", "s-"), ("gradsync_fixed", "^:")):
        if f"{name}_ms" not in rows[0]:
            continue
        eff.plot(ranks, [r[f"{name}_efficiency"] for r in rows], style, label=f"{name} (measured)")
        step.plot(ranks, [r[f"{name}_ms"] for r in rows], style, label=name)
    base = rows[0]["predicted_ms"]
    eff.plot(ranks, [base / r["predicted_ms"] for r in rows], "k--", label="gradsync plan (predicted)")
    step.plot(ranks, [r["predicted_ms"] for r in rows], "k--", label="predicted")
    _breakdown(parts, rows)
    for axis, label in ((eff, "E(N) = step(1) / step(N)"), (step, "ms per step (median)")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("ranks N")
        axis.set_ylabel(label)
        axis.legend(fontsize=8)
        axis.grid(alpha=0.3)
    eff.set_ylim(0, 1.1)
    title = f"{summary['model']}, {summary['ranks_per_host']} ranks per host, {summary['link']} per host (scaled 1/"
    slow = summary.get("slow_motion", 1.0)
    fig.suptitle(title + f"{summary['scale']:g}" + (f", slow motion x{slow:g})" if slow != 1 else ")"))
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _breakdown(axis: Any, rows: list[dict]) -> None:
    """Stacked bars per N for gradsync's default: the forward (measured; it communicates nothing), backward compute
    (twice the forward, the profile's ratio) and the rest of the step, communication that backward did not hide."""
    name = "gradsync" if rows[0].get("gradsync_forward_ms") else "torch"
    labels = [str(r["ranks"]) for r in rows]
    forward = [r.get(f"{name}_forward_ms") or 0.0 for r in rows]
    backward = [2 * f for f in forward]
    exposed = [max(0.0, r[f"{name}_ms"] - f - b) for r, f, b in zip(rows, forward, backward)]
    axis.bar(labels, forward, label="forward")
    axis.bar(labels, backward, bottom=forward, label="backward compute")
    axis.bar(labels, exposed, bottom=[f + b for f, b in zip(forward, backward)], label="exposed communication")
    axis.set_xlabel("ranks N")
    axis.set_ylabel(f"ms per step ({name})")
    axis.legend(fontsize=8)
    axis.grid(alpha=0.3, axis="y")
