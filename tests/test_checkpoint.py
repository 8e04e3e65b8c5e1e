"""Checkpoints: a kill mid-save leaves the old one loadable; an interrupted and resumed run ends bit-identical."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import gradsync
from gradsync import checkpoint
from gradsync.testing import spawn

SCRIPTS = Path(__file__).parent / "scripts"


@pytest.mark.long
@pytest.mark.timeout(180)
def test_sigkill_during_save_leaves_previous_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    rng = random.Random(0)
    killed_mid_save = rounds = 0
    while rounds < 4 or (killed_mid_save == 0 and rounds < 12):  # a busy machine can make a random kill miss
        rounds += 1
        proc = subprocess.Popen(
            [sys.executable, str(SCRIPTS / "save_forever.py"), str(path)], stdout=subprocess.PIPE, text=True
        )
        assert proc.stdout.readline().startswith("saved")  # at least one complete checkpoint exists
        time.sleep(rng.uniform(0.05, 0.4))
        mid_save = any(p.name.startswith(".ckpt.pt.tmp-") for p in tmp_path.iterdir())
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        killed_mid_save += mid_save
        state = torch.load(path, weights_only=False)
        assert torch.equal(state["weights"], torch.full((10_000_000,), float(state["i"])))
    assert killed_mid_save >= 1, "no kill landed during a save; the test proved nothing"


class Dropper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.3), nn.Linear(32, 1))

    def forward(self, x):
        return self.net(x)


def _train(rank: int, world_size: int, ckpt: str, stop_after: int | None, resume: bool) -> dict:
    torch.manual_seed(100 + rank)  # per-rank streams: dropout differs between ranks
    data = torch.utils.data.TensorDataset(
        torch.randn(96, 8, generator=torch.Generator().manual_seed(0)),
        torch.randn(96, 1, generator=torch.Generator().manual_seed(1)),
    )
    model = Dropper()
    ddp = gradsync.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = gradsync.DistributedLoader(data, batch_size=8, seed=3)
    step, start_epoch = 0, 0
    if resume:
        extras = checkpoint.restore(checkpoint.load(ckpt), model=ddp, optimizer=opt, loader=loader)
        step, start_epoch = extras["step"], extras["epoch"]
    for epoch in range(start_epoch, 3):
        loader.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad()
            nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
            step += 1
            if step == stop_after:
                checkpoint.save(ckpt, model=ddp, optimizer=opt, loader=loader, step=step, epoch=epoch)
                return {"stopped": step}
    return {k: v.clone() for k, v in model.state_dict().items()} | {"step": step}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stop_after", [4, 6, 11])  # mid-epoch, at an epoch's end, in the last epoch
def test_interrupted_and_resumed_equals_uninterrupted(tmp_path: Path, stop_after: int) -> None:
    ckpt = str(tmp_path / "c.pt")
    full = spawn(_train, args=(ckpt, None, False), timeout=100)
    assert spawn(_train, args=(ckpt, stop_after, False), timeout=100)[0] == {"stopped": stop_after}
    resumed = spawn(_train, args=(ckpt, None, True), timeout=100)
    for a, b in zip(full, resumed):
        assert a["step"] == b["step"] == 18
        for key in ("net.0.weight", "net.2.weight", "net.2.bias"):
            assert torch.equal(a[key], b[key]), key


def test_restore_names_missing_entries(tmp_path: Path) -> None:
    checkpoint.save(tmp_path / "x.pt", step=3)
    with pytest.raises(gradsync.errors.CheckpointError, match="has no 'optimizer'"):
        checkpoint.restore(checkpoint.load(tmp_path / "x.pt"), optimizer=torch.optim.SGD([nn.Parameter(torch.ones(1))]))
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        checkpoint.load(tmp_path / "missing.pt")


# ---------------------------------------------------------------- issue 58: what the generated sweep found
def _net(width: int = 8) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 2))


def test_restoring_another_models_checkpoint_names_the_entry(tmp_path: Path) -> None:
    checkpoint.save(tmp_path / "wide.pt", model=_net(16))
    saved = checkpoint.load(tmp_path / "wide.pt")
    with pytest.raises(
        gradsync.errors.CheckpointError, match=r"(?s)restore: 'model' was saved from another model .*size mismatch"
    ):
        checkpoint.restore(saved, model=_net(8))


def test_a_directory_is_not_a_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(gradsync.errors.CheckpointError, match="is a directory, not a checkpoint"):
        checkpoint.load(tmp_path)


def test_an_unpicklable_state_is_refused_and_the_previous_file_is_kept(tmp_path: Path) -> None:
    path = tmp_path / "state.pt"
    checkpoint.atomic_torch_save({"step": 3}, path)
    with pytest.raises(gradsync.errors.CheckpointError, match="cannot pickle it .* was left as it was"):
        checkpoint.atomic_torch_save({"step": 4, "fn": lambda: None}, path)
    assert torch.load(path) == {"step": 3}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.pt"]


def test_set_rng_state_names_what_it_needs() -> None:
    with pytest.raises(
        gradsync.errors.ConfigError, match=r"set_rng_state: the state has no 'torch', 'numpy', 'python'"
    ):
        checkpoint.set_rng_state({})
    with pytest.raises(gradsync.errors.ConfigError, match="the state must be a dict from state_dict"):
        checkpoint.set_rng_state(3)  # type: ignore[arg-type]
