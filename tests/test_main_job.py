"""The main job (examples/train_digits.py) on 2 ranks: learns, and resumes from its checkpoint mid-epoch."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).parents[1] / "examples" / "train_digits.py"


def _launch(cwd: Path, script: Path, *script_args: str) -> subprocess.CompletedProcess:
    """`gradsync run --nproc-per-node 2 script ...` in a clean environment; the run must succeed."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_"))}
    cmd = [sys.executable, "-m", "gradsync", "run", "--nproc-per-node", "2", "--standalone", str(script), *script_args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=cwd)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def _run(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    return _launch(tmp_path, EXAMPLE, "--out", str(tmp_path / "ckpt"), *extra)


@pytest.mark.timeout(300)
def test_trains_and_resumes(tmp_path: Path) -> None:
    proc = _run(tmp_path, "--epochs", "3", "--trace", str(tmp_path / "trace.json"))
    accuracy = float(re.search(r"FINAL_ACCURACY (\S+)", proc.stdout).group(1))
    assert accuracy > 0.8, proc.stdout  # chance is 0.1
    assert "where each step's time goes" in proc.stdout and (tmp_path / "trace.json").exists()

    # Interrupted at step 30 (epoch 1, batch 7 of 23), then resumed: the step count continues, no batch lost.
    fresh = tmp_path / "second"
    fresh.mkdir()
    _run(fresh, "--epochs", "3", "--max-steps", "30")
    resumed = _run(fresh, "--epochs", "3", "--resume")
    assert "resumed from" in resumed.stdout and "epoch 1, step 30" in resumed.stdout
    assert "done: 69 steps" in resumed.stdout
    assert float(re.search(r"FINAL_ACCURACY (\S+)", resumed.stdout).group(1)) > 0.8


@pytest.mark.timeout(180)
def test_char_transformer_with_no_sync_accumulation_learns(tmp_path: Path) -> None:
    proc = _launch(tmp_path, EXAMPLE.with_name("train_chars.py"), "--steps", "40", "--accum", "2")
    found = re.search(r"FINAL_VAL_LOSS (\S+) UNIFORM (\S+)", proc.stdout)
    assert float(found.group(1)) < 0.6 * float(found.group(2)), proc.stdout  # far better than guessing
