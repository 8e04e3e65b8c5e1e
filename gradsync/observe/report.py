"""``gradsync report TRACE.json``: a table of where the time went (slowest rank, exposed communication) and a
PNG with one step's timeline per rank above a stacked bar of each rank's median breakdown."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console

from gradsync.errors import ConfigError
from gradsync.observe.breakdown import median_breakdown
from gradsync.observe.recorder import StepRecord
from gradsync.observe.table import summary_table
from gradsync.observe.trace import read_steps

PHASES = [("forward", "tab:blue"), ("backward", "tab:orange"), ("exposed_comm", "tab:red"), ("optimizer", "tab:green")]


def plot(per_rank: dict[int, list[StepRecord]], out: Path, step: int = -1) -> None:
    """Write a PNG: ``step``'s timeline on every rank, above each rank's median breakdown."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (timeline, bars) = plt.subplots(2, 1, figsize=(11, 2.2 + 1.1 * len(per_rank)), constrained_layout=True)
    _draw_timeline(timeline, per_rank, step)
    _draw_breakdown(bars, per_rank)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _draw_timeline(axes, per_rank: dict[int, list[StepRecord]], step: int) -> None:
    ranks = sorted(per_rank)
    origin = min(steps[step].forward_start for steps in per_rank.values() if steps)
    for y, rank in enumerate(ranks):
        if not per_rank[rank]:
            continue  # a rank that recorded nothing keeps its empty row
        s = per_rank[rank][step]
        spans = [
            (s.forward_start, s.forward_end, "tab:blue"),
            (s.forward_end, s.backward_end, "tab:orange"),
            (s.backward_end, s.comm_end, "tab:red"),
            (s.optimizer_start, s.optimizer_end, "tab:green"),
        ]
        for start, end, color in spans:
            if start and end:
                axes.broken_barh([((start - origin) * 1e3, (end - start) * 1e3)], (y - 0.4, 0.35), color=color)
        for b in s.buckets:
            if b.launch and b.done:
                axes.broken_barh(
                    [((b.launch - origin) * 1e3, (b.done - b.launch) * 1e3)],
                    (y + 0.05, 0.35),
                    color="tab:purple",
                    alpha=0.5 + 0.5 * (b.index % 2),
                    edgecolor="black",
                )
    axes.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    axes.set_xlabel("ms since the step began (lower bar: compute; upper bar: bucket all-reduces)")
    axes.set_title("one step's timeline")


def _draw_breakdown(axes, per_rank: dict[int, list[StepRecord]]) -> None:
    ranks = sorted(per_rank)
    bottom = [0.0] * len(ranks)
    medians = [median_breakdown(per_rank[r]) for r in ranks]
    for phase, color in PHASES:
        values = [getattr(m, phase) * 1e3 if m else 0.0 for m in medians]
        axes.barh([f"rank {r}" for r in ranks], values, left=bottom, color=color, label=phase.replace("_", " "))
        bottom = [a + b for a, b in zip(bottom, values)]
    axes.set_xlabel("median ms per step")
    axes.legend(loc="lower right", fontsize="small")
    axes.set_title("where each step's time goes")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gradsync report", description=__doc__)
    parser.add_argument("trace", type=Path, help="a trace written by Monitor.export_chrome_trace")
    parser.add_argument("--out", type=Path, help="PNG to write (default: TRACE with .png)")
    parser.add_argument("--step", type=int, default=-1, help="which step's timeline to draw (default: last)")
    args = parser.parse_args(argv)
    per_rank = read_steps(args.trace)
    _check_step(per_rank, args.trace, args.step)
    Console().print(summary_table(per_rank))
    out = args.out or args.trace.with_suffix(".png")
    try:
        plot(per_rank, out, args.step)
    except OSError as exc:
        raise ConfigError(
            f"cannot write the plot '{out}': {exc.strerror or exc}; pass --out a path you can write."
        ) from None
    print(f"wrote {out}")
    return 0


def _check_step(per_rank: dict[int, list[StepRecord]], trace: Path, step: int) -> None:
    """The trace holds steps, and every rank holds step ``step`` (each rank's timeline is drawn for it)."""
    if not any(per_rank.values()):
        raise ConfigError(
            f"'{trace}' holds no steps: the run exported its trace before any training step completed with the "
            "Monitor attached. Export it after training (Monitor.export_chrome_trace)."
        )
    count = min(len(steps) for steps in per_rank.values() if steps)
    if not -count <= step < count:
        raise ConfigError(
            f"--step {step}: the trace holds {count} step(s) on each rank; give 0 to {count - 1}, or -1 (the last)."
        )
