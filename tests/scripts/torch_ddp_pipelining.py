"""torch's DDP under torch's PipelineStage, on tests/test_pipelining.py's model and schedules (docs/parallelism.md's
table): each schedule's largest parameter difference from one process training on the whole batch, after 1 and 2
SGD steps, or the error it stops with; gradsync's stage beside it.

    python tests/scripts/torch_ddp_pipelining.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))

import test_pipelining as case  # noqa: E402
import torch  # noqa: E402

from gradsync.testing import SpawnError, spawn  # noqa: E402


def _difference(rank: int, world: int, schedule: str, ours: bool, options: dict, steps: int) -> float:
    torch.set_num_threads(1)
    trained = case._train(schedule, ours, options, steps=steps)
    return case._max_diff(trained, case._reference(False, steps=steps))


def _outcome(schedule: str, ours: bool, options: dict, steps: int) -> str:
    try:
        return f"{max(spawn(_difference, world_size=4, args=(schedule, ours, options, steps), timeout=120)):.1e}"
    except SpawnError as error:  # the root cause, not the peers' "connection closed" or the stage's wrapper
        lines = [line for f in error.failures.values() for line in f.traceback.splitlines()]
        causes = [line for line in lines if "Error: " in line and "Connection closed" not in line]
        return "fails: " + (causes[0].split("Error: ", 1)[1][:100] if causes else lines[-1][:100])


if __name__ == "__main__":
    runs = [(name, {}) for name in case.SCHEDULES] + [("1F1B", {"static_graph": True})]
    for name, options in runs:
        label = name + (" static_graph" if options else "")
        for steps in (1, 2):
            theirs, ours = _outcome(name, False, options, steps), _outcome(name, True, options, steps)
            print(f"{label:<28} step {steps}  torch's DDP: {theirs:<60}  gradsync: {ours}", flush=True)
