"""gradsync from the trainers people use: a LightningModule with the gradsync strategy, a Fabric loop and an
Accelerate script end with the same weights as with their own DDP (2 CPU processes each, under ``gradsync run``).
Skipped where Lightning or Accelerate is not installed (``pip install gradsync[lightning,accelerate]``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPTS = Path(__file__).parent / "scripts"


def _train(script: str, kind: str, out: Path, timeout: float = 150) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "PYTHONWARNINGS": "ignore"}
    command = [sys.executable, "-m", "gradsync", "run", "--nproc-per-node", "2", str(SCRIPTS / script), kind, str(out)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return torch.load(out)


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-6, msg=key)


@pytest.mark.timeout(400)
def test_lightning_trainer_with_the_gradsync_strategy_matches_ddp(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    _same(
        _train("lightning_train.py", "gradsync", tmp_path / "g.pt"),
        _train("lightning_train.py", "ddp", tmp_path / "t.pt"),
    )


@pytest.mark.timeout(400)
def test_lightning_fabric_with_the_gradsync_strategy_matches_ddp(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    ours = _train("fabric_train.py", "gradsync", tmp_path / "g.pt")
    _same(ours, _train("fabric_train.py", "ddp", tmp_path / "t.pt"))


@pytest.mark.timeout(400)
def test_accelerate_with_gradsync_matches_accelerates_ddp(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    _same(
        _train("accelerate_train.py", "gradsync", tmp_path / "g.pt"),
        _train("accelerate_train.py", "ddp", tmp_path / "t.pt"),
    )
