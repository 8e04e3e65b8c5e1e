"""The main job (examples/train_digits.py) on 2 ranks: learns, and resumes from its checkpoint mid-epoch."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
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


@pytest.mark.long
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


@pytest.mark.long
@pytest.mark.timeout(240)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_char_transformer_with_no_sync_accumulation_learns(tmp_path: Path, precision: str) -> None:
    """In float32, and with mixed precision (bf16 compute, float32 master weights: the parameters stay float32)."""
    extra = ["--bf16"] if precision == "bf16" else []
    proc = _launch(tmp_path, EXAMPLE.with_name("train_chars.py"), "--steps", "20", "--accum", "2", *extra)
    found = re.search(r"FINAL_VAL_LOSS (\S+) UNIFORM (\S+)", proc.stdout)
    assert float(found.group(1)) < 0.6 * float(found.group(2)), proc.stdout  # far better than guessing


@pytest.mark.long
@pytest.mark.timeout(180)
@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (Debian: apt-get install tmux)")
def test_in_a_terminal_each_epochs_bar_comes_before_its_line(tmp_path: Path) -> None:
    """`gradsync run` on the main job in a real terminal (a tmux pane): each epoch's progress bar, then its line.
    One Progress for every epoch kept all the bars in rich's live region, below every epoch line (the same
    without gradsync run: rich's layout, not the launcher's)."""
    session = f"gsmain{os.getpid()}"
    done = tmp_path / "done"
    command = f"{sys.executable} -m gradsync run --nproc-per-node 2 --standalone {EXAMPLE} --epochs 3 --out "
    command += f"{tmp_path / 'ckpt'}; touch {done}; sleep 60"
    pane_size = ["-x", "150", "-y", "60"]
    subprocess.run(["tmux", "new-session", "-d", "-s", session, *pane_size, command], check=True, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 150
        while not done.exists():
            assert time.monotonic() < deadline, "the job did not end"
            time.sleep(0.5)
        pane = subprocess.run(["tmux", "capture-pane", "-t", session, "-p"], capture_output=True, text=True).stdout
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
    lines = [line for line in pane.splitlines() if re.match(r"epoch \d", line)]
    expected = [f"epoch {e}{kind}" for e in range(3) for kind in (" ━", ": test accuracy")]
    assert [line[: len(want)] for line, want in zip(lines, expected)] == expected and len(lines) == 6, pane
