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


@pytest.mark.long
@pytest.mark.timeout(400)
def test_lightning_trainer_with_the_gradsync_strategy_matches_ddp(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    _same(
        _train("lightning_train.py", "gradsync", tmp_path / "g.pt"),
        _train("lightning_train.py", "ddp", tmp_path / "t.pt"),
    )


@pytest.mark.long
@pytest.mark.timeout(400)
def test_lightning_fabric_with_the_gradsync_strategy_matches_ddp(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    ours = _train("fabric_train.py", "gradsync", tmp_path / "g.pt")
    _same(ours, _train("fabric_train.py", "ddp", tmp_path / "t.pt"))


@pytest.mark.long
@pytest.mark.timeout(400)
def test_accelerate_with_gradsync_matches_accelerates_ddp(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    _same(
        _train("accelerate_train.py", "gradsync", tmp_path / "g.pt"),
        _train("accelerate_train.py", "ddp", tmp_path / "t.pt"),
    )


def _ray_env() -> dict[str, str]:
    # Ray's workers import gradsync from this checkout; no dashboard, no usage report (a closed network).
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "LOCAL_"))}
    root = str(Path(__file__).parents[1])
    return env | {"PYTHONPATH": root, "RAY_USAGE_STATS_ENABLED": "0", "RAY_DISABLE_DOCKER_CPU_WARNING": "1"}


@pytest.mark.long
@pytest.mark.timeout(300)
def test_ray_runs_the_docs_block_and_matches_rays_ddp(tmp_path: Path) -> None:
    """docs/integrations.md's Ray block (its third, after Lightning's and Accelerate's), as written, then gradsync
    under TorchTrainer against Ray's own prepare_model (torch's DDP): the same weights, bit for bit. One local Ray
    cluster for both (starting one costs ~20 s), and one TorchTrainer run that trains both wrappers in turn."""
    pytest.importorskip("ray.train", reason="Ray Train (pip install -e '.[ray]') is not installed")
    import json

    from docs_blocks import block

    docs_block = tmp_path / "ray_docs_block.py"
    docs_block.write_text(block("docs/integrations.md", "python", "Lightning, Hugging Face Accelerate", 2, count=3))
    assert "TorchTrainer(" in docs_block.read_text()
    run = subprocess.run(
        [sys.executable, str(SCRIPTS / "ray_train.py"), str(tmp_path), str(docs_block)],
        env=_ray_env(),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert (tmp_path / "docs-block-ran").exists()
    ours = [json.loads((tmp_path / f"gradsync-{r}.json").read_text()) for r in range(2)]
    rays = [json.loads((tmp_path / f"torch-{r}.json").read_text()) for r in range(2)]
    assert ours == rays and ours[0] == ours[1]  # bit for bit, and the two workers agree
