"""The rich table shared by ``Monitor.print_summary`` and ``gradsync report``."""

from __future__ import annotations

from rich.table import Table

from gradsync.observe.breakdown import median_breakdown, slowest_rank
from gradsync.observe.recorder import StepRecord


def summary_table(per_rank: dict[int, list[StepRecord]]) -> Table:
    medians = {r: b for r, steps in sorted(per_rank.items()) if (b := median_breakdown(steps)) is not None}
    slow = slowest_rank(per_rank)
    caption = "ms, median over steps (first skipped); exposed = wait for all-reduce after backward"
    if slow is not None:
        caption += f"\nslowest rank: {slow[0]} (arrived last at collectives, median {slow[1] * 1e3:.2f} ms late)"
    table = Table(title="gradsync: where each step's time goes", caption=caption)
    for col in ("rank", "forward", "backward", "exposed", "optim", "step", "overlap", "MiB", "buckets"):
        table.add_column(col, justify="right")
    for rank, b in medians.items():
        table.add_row(
            str(rank),
            f"{b.forward * 1e3:.2f}",
            f"{b.backward * 1e3:.2f}",
            f"{b.exposed_comm * 1e3:.2f}",
            f"{b.optimizer * 1e3:.2f}",
            f"{b.total * 1e3:.2f}",
            f"{b.overlap:.0%}",
            f"{b.bytes / 2**20:.2f}",
            str(b.buckets),
        )
    return table
