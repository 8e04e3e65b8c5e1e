"""The scaling lab's PNG: weak-scaling efficiency E(N) of torch's DDP and gradsync's, with the planner's
prediction, and the step time against N."""

from __future__ import annotations

from pathlib import Path


def plot(summary: dict, out: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = summary["rows"]
    ranks = [r["ranks"] for r in rows]
    fig, (eff, step) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, style in (("torch", "o-"), ("gradsync", "s-"), ("gradsync_fixed", "^:")):
        if f"{name}_ms" not in rows[0]:
            continue
        eff.plot(ranks, [r[f"{name}_efficiency"] for r in rows], style, label=f"{name} (measured)")
        step.plot(ranks, [r[f"{name}_ms"] for r in rows], style, label=name)
    base = rows[0]["predicted_ms"]
    eff.plot(ranks, [base / r["predicted_ms"] for r in rows], "k--", label="gradsync plan (predicted)")
    step.plot(ranks, [r["predicted_ms"] for r in rows], "k--", label="predicted")
    for axis, label in ((eff, "E(N) = step(1) / step(N)"), (step, "ms per step (median)")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("ranks N")
        axis.set_ylabel(label)
        axis.legend(fontsize=8)
        axis.grid(alpha=0.3)
    eff.set_ylim(0, 1.1)
    title = f"{summary['model']}, {summary['ranks_per_host']} ranks per host, {summary['link']} per host (scaled 1/"
    fig.suptitle(title + f"{summary['scale']:g})")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
