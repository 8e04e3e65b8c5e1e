"""examples/gpt_3d.py on 8 gloo ranks (DP = 2 x TP = 2 x PP = 2): its loss curve equals the same run with torch's
DDP over the same mesh, plan and schedule, and the model learns."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).parents[1] / "examples" / "gpt_3d.py"
STEPS = 12


def _losses(cwd: Path) -> dict[str, list[float]]:
    """Each DDP's loss curve, from one launch that trains with gradsync's, then with torch's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "LOCAL_"))}
    env.update(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "gradsync", "run", "--standalone", "--nproc-per-node", "8", str(EXAMPLE)]
    cmd += ["--steps", str(STEPS), "--ddp", "gradsync", "torch"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env, cwd=cwd)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    lines = [json.loads(s) for s in proc.stdout.splitlines() if s.startswith('{"ddp"')]
    assert [line["ddp"] for line in lines] == ["gradsync", "torch"], proc.stdout[-2000:]
    return {line["ddp"]: line["losses"] for line in lines}


@pytest.mark.long
@pytest.mark.timeout(600)
def test_3d_parallel_gpt_learns_and_its_loss_curve_equals_torchs_ddp(tmp_path: Path) -> None:
    curves = _losses(tmp_path)
    ours, theirs = curves["gradsync"], curves["torch"]
    assert len(ours) == STEPS and len(theirs) == STEPS
    assert max(abs(a - b) for a, b in zip(ours, theirs)) <= 1e-5, (ours, theirs)
    assert ours[-1] < 0.8 * ours[0], ours  # it learns
