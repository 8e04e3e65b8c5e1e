"""Monitor: attach to a DDP model (and optimizer) to see where each step's time goes, on every rank.

Costs nothing until attached; attached, a few clock marks per bucket and per step (CUDA events on a GPU, so the
figures are the GPU's, not the host's launch times).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from gradsync.collectives.communicator import Op
from gradsync.errors import ConfigError
from gradsync.observe.breakdown import StepBreakdown, median_breakdown
from gradsync.observe.recorder import StepRecord, StepRecorder
from gradsync.observe.trace import write_chrome_trace
from gradsync.validate import require_ddp, require_int


class Monitor:
    """Per-step breakdown, bucket timeline and straggler view for one DDP model.

    Example::

        monitor = Monitor(ddp, optimizer)
        for x, y in loader:
            ...                                  # train as usual
        monitor.print_summary()                  # on every rank (collective); rank 0 prints
        monitor.export_chrome_trace("trace.json")  # collective; open in ui.perfetto.dev or `gradsync report`
    """

    def __init__(self, ddp: Any, optimizer: torch.optim.Optimizer | None = None, max_steps: int = 10_000) -> None:
        require_ddp("Monitor", ddp)
        require_int("Monitor", "max_steps", max_steps, minimum=1)
        # What it uses of an optimizer: torch.optim.Optimizer's step hooks (a wrapper that has them will do).
        if optimizer is not None and not callable(getattr(optimizer, "register_step_pre_hook", None)):
            raise ConfigError(
                f"Monitor: optimizer must be a torch.optim.Optimizer (its steps are timed) or None, got "
                f"{type(optimizer).__name__} {optimizer!r:.60}"
            )
        self.ddp = ddp
        device = next(ddp.module.parameters(), torch.empty(0)).device  # whose clock times the steps
        self.recorder = StepRecorder(max_steps, device)
        ddp.attach_recorder(self.recorder)
        self._handles = []
        if optimizer is not None:
            self._handles.append(optimizer.register_step_pre_hook(lambda *_: self.recorder.optimizer_start()))
            self._handles.append(optimizer.register_step_post_hook(lambda *_: self.recorder.optimizer_end()))

    def detach(self) -> None:
        """Stop recording (the reducer goes back to its zero-cost path)."""
        self.ddp.detach_recorder()
        for handle in self._handles:
            handle.remove()
        self._handles = []

    @property
    def steps(self) -> list[StepRecord]:
        return self.recorder.steps

    def breakdown(self, skip_first: int = 1) -> StepBreakdown | None:
        """This rank's median step breakdown (no communication)."""
        return median_breakdown(self.recorder.steps, skip_first)

    def gather(self) -> dict[int, list[StepRecord]]:
        """Every rank's step records, on every rank (a collective: call on all ranks)."""
        comm = self.ddp.communicator
        everyone = comm.all_gather_object(Op.MONITOR_GATHER, self.recorder.steps)
        return {comm.global_rank(i): steps for i, steps in enumerate(everyone)}

    def export_chrome_trace(self, path: str | os.PathLike) -> None:
        """Write all ranks' timelines into one Chrome-trace JSON (collective; rank 0 writes)."""
        per_rank = self.gather()
        if dist.get_rank() == 0:
            write_chrome_trace(per_rank, path)

    def print_summary(self, console: Any = None) -> None:
        """Print a table of every rank's median breakdown and the slowest rank (collective; rank 0 prints)."""
        per_rank = self.gather()
        if dist.get_rank() == 0:
            from rich.console import Console

            from gradsync.observe.table import summary_table

            console = console or Console()
            console.print(summary_table(per_rank))
            console.print(self.bucket_layout())

    def bucket_layout(self) -> str:
        """One line on this rank's buckets and, when the tuner chose their caps, its reasoning."""
        reducer = self.ddp.reducer
        sizes = [b.nbytes / 2**20 for b in reducer.buckets]
        line = f"{len(sizes)} bucket(s) of {min(sizes):.2f}-{max(sizes):.2f} MiB"
        if reducer.tuning is not None:
            line += f"; tuned at the rebuild: {reducer.tuning.describe()}"
        return line

    def log_to_tensorboard(self, writer: Any, global_step: int) -> None:
        """Write this rank's latest median breakdown as scalars (``torch.utils.tensorboard.SummaryWriter``)."""
        b = self.breakdown()
        if b is None:
            return
        for name in ("forward", "backward", "exposed_comm", "optimizer", "total", "overlap"):
            writer.add_scalar(f"gradsync/{name}", getattr(b, name), global_step)
        writer.add_scalar("gradsync/bytes", b.bytes, global_step)
