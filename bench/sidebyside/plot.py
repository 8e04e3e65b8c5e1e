"""The PNG beside each benchmark JSON: per variant, the median step split into forward / backward (which includes
the communication that did not overlap) / a separate all-reduce / optimizer, with the overlap bound as a line."""

from __future__ import annotations

from pathlib import Path


def plot(result: dict, out: Path) -> Path | None:
    """Write ``out`` (a PNG) from a bench result; None if matplotlib is not installed (an optional extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    variants = result["variants"]
    names = list(variants)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(names) + 2), 4.2))
    bottom = [0.0] * len(names)
    segments = (
        ("forward_ms", "#4c72b0"),
        ("backward_ms", "#dd8452"),
        ("allreduce_ms", "#c44e52"),
        ("optimizer_ms", "#55a868"),
    )
    for key, color in segments:  # allreduce_ms: the `allreduce` variant's all-reduce after backward
        heights = [variants[n].get(key, 0.0) for n in names]
        ax.bar(names, heights, bottom=bottom, color=color, label=key.removesuffix("_ms"))
        bottom = [b + h for b, h in zip(bottom, heights)]
    for k, name in enumerate(names):
        ratio = variants[name].get("ratio_vs_torch")
        label = f"{variants[name]['median_ms']:.0f} ms" + (f"\n{ratio:.3f}x" if ratio else "")
        ax.text(k, bottom[k], label, ha="center", va="bottom", fontsize=8)
    bound = result.get("overlap_bound_ms")
    if bound:
        ax.axhline(bound, color="black", linestyle="--", linewidth=1, label=f"overlap bound {bound:.0f} ms")
    ax.set_ylabel("ms per step (median)")
    ax.set_title(f"{result['model']} on {result.get('link', '?')}: ratio = median of paired steps vs torch DDP")
    ax.tick_params(axis="x", labelrotation=20, labelsize=8)
    ax.legend(fontsize=8, loc="lower right", framealpha=0.9)
    ax.margins(y=0.15)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
