"""OverlappedOptimizer: stepping each bucket as its average arrives gives exactly the parameters of stepping after
backward, works with schedulers and accumulation, and its state dict is the plain optimizer's."""

from __future__ import annotations

import pytest
import torch
from ddp_cases import BATCH, batch
from torch import nn

import gradsync
from gradsync.optim import OverlappedOptimizer
from gradsync.testing import spawn
from lab.zoo.toys import build

KINDS = {"adam": (torch.optim.Adam, {"lr": 1e-2}), "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})}


def _train(rank: int, world_size: int, kind: str, overlapped: bool, view: bool) -> dict:
    module = build("tied")  # tied and frozen parameters too
    ddp = gradsync.DistributedDataParallel(module, bucket_cap_mb=0.0005, gradient_as_bucket_view=view)
    cls, kw = KINDS[kind]
    trainable = [p for p in module.parameters() if p.requires_grad]
    opt = OverlappedOptimizer(ddp, cls, **kw) if overlapped else cls(trainable, **kw)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for step in range(5):
        opt.zero_grad()
        for micro in range(2):  # accumulation: the first micro-batch under no_sync
            x, y = batch(step, micro, world_size)
            sl = slice(rank * BATCH, (rank + 1) * BATCH)
            ctx = ddp.no_sync() if micro == 0 else torch.enable_grad()
            with ctx:
                nn.functional.mse_loss(ddp(x[sl]), y[sl]).backward()
        opt.step()
        sched.step()
    return {"params": {k: v.clone() for k, v in module.named_parameters()}, "state": opt.state_dict()}


def _both(rank: int, world_size: int, kind: str, view: bool) -> tuple[dict, dict]:
    return _train(rank, world_size, kind, True, view), _train(rank, world_size, kind, False, view)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("kind,view", [("adam", False), ("sgd", False), ("adam", True)])
def test_same_parameters_and_state_as_stepping_after_backward(kind: str, view: bool) -> None:
    for overlapped, plain in spawn(_both, args=(kind, view), timeout=80):
        for k in plain["params"]:
            assert torch.equal(overlapped["params"][k], plain["params"][k]), k
        assert overlapped["state"]["param_groups"][0]["lr"] == plain["state"]["param_groups"][0]["lr"]
        for i, s in plain["state"]["state"].items():
            for name, value in s.items():
                assert torch.equal(torch.as_tensor(overlapped["state"]["state"][i][name]), torch.as_tensor(value))


def _refused(rank: int, world_size: int) -> str:
    ddp = gradsync.DistributedDataParallel(build("mlp"), find_unused_parameters=True)
    try:
        OverlappedOptimizer(ddp, torch.optim.SGD, lr=0.1)
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.timeout(60)
def test_refuses_find_unused_parameters_with_the_reason() -> None:
    assert "cannot be used with find_unused_parameters=True" in spawn(_refused, timeout=50)[0]


def _too_late(rank: int, world_size: int, what: str) -> str:
    torch.manual_seed(0)
    module = build("mlp")
    ddp = gradsync.DistributedDataParallel(module, bucket_cap_mb=0.0005)
    opt = OverlappedOptimizer(ddp, torch.optim.SGD, lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    x, y = batch(0, 0, world_size)
    for step in range(2):
        opt.zero_grad()
        loss = nn.functional.mse_loss(ddp(x[:BATCH]), y[:BATCH])
        try:
            if what == "scaler":
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                if what == "clip":
                    torch.nn.utils.clip_grad_norm_(module.parameters(), max_norm=1e6)  # scales by 1.0, in place
                opt.step()
        except gradsync.GradsyncError as exc:
            return f"step {step}: {exc}"
    return "no error"


@pytest.mark.timeout(90)
def test_refuses_a_grad_scaler_and_gradients_changed_after_backward_by_name() -> None:
    """Each bucket was stepped inside backward: a GradScaler (scaled gradients, inf never checked) and clipping
    after backward come too late, and are refused at the first step; a plain loop is untouched."""
    scaler, clip, plain = (spawn(_too_late, args=(what,), timeout=80)[0] for what in ("scaler", "clip", "plain"))
    assert scaler.startswith("step 0:") and "GradScaler" in scaler, scaler
    assert clip.startswith("step 0:") and "gradient clipping" in clip, clip
    assert plain == "no error"


# ---------------------------------------------------------------- restoring a state (issue 58: the generated sweep)
def _model(width: int = 8) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 2))


def _steps(module: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        opt.zero_grad()
        x = torch.randn(4, 4, generator=torch.Generator().manual_seed(step))
        module(x).pow(2).mean().backward()
        opt.step()


def test_a_saved_state_restores_and_training_goes_on_as_torchs_adam(group_of_one: None) -> None:
    """Saved after 2 steps and restored into a fresh model and optimizer, 2 more steps equal 4 steps of a plain
    torch Adam. Its state_dict used to keep only the hyperparameters given (lr): the restored Adam raised
    KeyError 'betas' at the first backward."""
    ref = _model()
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    _steps(ref, ref_opt, range(4))
    first = gradsync.DistributedDataParallel(_model())
    opt = OverlappedOptimizer(first, torch.optim.Adam, lr=1e-2)
    _steps(first, opt, range(2))
    saved_model, saved_opt = first.module.state_dict(), opt.state_dict()
    assert {"betas", "eps", "weight_decay"} <= set(saved_opt["param_groups"][0])  # a plain Adam's state dict
    resumed = _model()
    resumed.load_state_dict(saved_model)
    again = gradsync.DistributedDataParallel(resumed)
    opt2 = OverlappedOptimizer(again, torch.optim.Adam, lr=1e-2)
    opt2.load_state_dict(saved_opt)
    _steps(again, opt2, range(2, 4))
    for (name, p), q in zip(resumed.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=name)


def test_a_state_saved_before_it_kept_every_hyperparameter_still_loads(group_of_one: None) -> None:
    ddp = gradsync.DistributedDataParallel(_model())
    opt = OverlappedOptimizer(ddp, torch.optim.Adam, lr=1e-2)
    _steps(ddp, opt, range(1))
    old = opt.state_dict()
    old["param_groups"] = [{"lr": 1e-2, "params": old["param_groups"][0]["params"]}]  # gradsync 0.1.0's layout
    opt.load_state_dict(old)
    _steps(ddp, opt, range(1, 2))


@pytest.mark.parametrize("which", ["another model", "another optimizer class"])
def test_a_state_that_does_not_fit_is_refused_and_nothing_changes(group_of_one: None, which: str) -> None:
    ddp = gradsync.DistributedDataParallel(_model())
    opt = OverlappedOptimizer(ddp, torch.optim.Adam, lr=1e-2)
    _steps(ddp, opt, range(1))
    other = _model(16) if which == "another model" else _model()
    other_opt = torch.optim.Adam(other.parameters(), lr=0.5)
    if which == "another optimizer class":
        other_opt = torch.optim.SGD(other.parameters(), lr=0.5, momentum=0.9)
    _steps(other, other_opt, range(1))
    before = opt.state_dict()
    with pytest.raises(gradsync.errors.ConfigError, match=f"OverlappedOptimizer.load_state_dict: .*saved by {which}"):
        opt.load_state_dict(other_opt.state_dict())
    after = opt.state_dict()
    assert after["param_groups"] == before["param_groups"]
    assert all(torch.equal(after["state"][0][k], v) for k, v in before["state"][0].items() if torch.is_tensor(v))
    _steps(ddp, opt, range(1, 2))  # and it trains on
