"""The bucket-size tuner: its cost model by hand, its choices on made-up timelines, and on real ranks that every
rank builds rank 0's buckets and the averages stay exact."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gradsync
from gradsync.observe.clock import HostClock
from gradsync.reducer import autotune, caps, rebuild
from gradsync.reducer.autotune import LinkCost, choose_size_limits, predict_finish, ready_seconds
from gradsync.reducer.buckets import MIB
from gradsync.reducer.rebuild import Trial
from gradsync.testing import spawn

DEFAULT = [MIB, 25 * MIB]


def _grads(mib_each: float, n: int) -> list[torch.Tensor]:
    return [torch.empty(int(mib_each * MIB) // 4) for _ in range(n)]


def test_predict_finish_by_hand() -> None:
    params = _grads(1, 3)  # 1 MiB each, ready at 1, 2 and 3 s, on a link doing 1 MiB/s with 0.5 s latency
    link = LinkCost(latency_s=0.5, bytes_per_s=MIB)
    ready = [1.0, 2.0, 3.0]
    # One bucket each: launched at 1, 2, 3; each takes 1.5 s, so the link is the bottleneck: 2.5, 4.0, 5.5.
    assert predict_finish(params, [0, 1, 2], ready, [MIB, MIB], link) == pytest.approx(5.5)
    # All in one bucket: launched at 3, 3 MiB take 3.5 s.
    assert predict_finish(params, [0, 1, 2], ready, [3 * MIB, 3 * MIB], link) == pytest.approx(6.5)
    # Nothing to send after backward ends: the finish is the last gradient's ready time.
    assert predict_finish(params, [0, 1, 2], ready, [MIB, MIB], LinkCost(0.0, 1e30)) == pytest.approx(3.0)


def test_slow_link_and_late_single_bucket_chooses_smaller_buckets() -> None:
    # The GPT benchmark's shape: 12 MiB of gradients ready evenly over 0.6 s of backward; with torch's caps all
    # but the first MiB wait for the end of backward.
    params = _grads(0.5, 24)
    ready = [0.025 * (k + 1) for k in range(24)]
    link = LinkCost(latency_s=2e-4, bytes_per_s=110e6)  # ~1 Gbit/s
    tuning = choose_size_limits(params, list(range(24)), ready, DEFAULT, link)
    assert tuning.proposed_limits != DEFAULT and tuning.size_limits == DEFAULT  # proposed; in force once measured
    assert tuning.proposed_limits[1] <= 4 * MIB
    assert min(tuning.predicted_s.values()) < 0.9 * tuning.default_s
    assert "MiB" in tuning.describe() and "MB/s" in tuning.describe()


def test_fast_link_keeps_torchs_default() -> None:
    params = _grads(0.5, 24)
    ready = [0.025 * (k + 1) for k in range(24)]
    link = LinkCost(latency_s=5e-5, bytes_per_s=20e9)  # communication is nearly free: nothing to gain
    tuning = choose_size_limits(params, list(range(24)), ready, DEFAULT, link)
    assert tuning.proposed_limits == DEFAULT


def test_latency_bound_link_keeps_large_buckets() -> None:
    # Many small gradients and an expensive launch: small buckets would pay the latency over and over.
    params = _grads(0.01, 400)
    ready = [1e-4 * (k + 1) for k in range(400)]
    link = LinkCost(latency_s=5e-3, bytes_per_s=10e9)
    tuning = choose_size_limits(params, list(range(400)), ready, DEFAULT, link)
    assert tuning.proposed_limits == DEFAULT
    assert "torch's: no cap predicted to save 5%" in tuning.describe()


def test_ready_seconds_fills_never_ready_with_the_end() -> None:
    assert ready_seconds(3, [2, 0], [10.5, 11.0], 10.0) == [1.0, 1.0, 0.5]
    assert ready_seconds(2, [], [], 10.0) == [0.0, 0.0]


def test_tuning_enabled(monkeypatch: pytest.MonkeyPatch) -> None:
    assert caps.tuning_enabled(None) and caps.tuning_enabled("auto")
    assert not caps.tuning_enabled(25)
    # On a GPU the tuner is not yet checked against measurement: it runs only when asked for.
    assert not caps.tuning_enabled(None, "cuda") and caps.tuning_enabled("auto", "cuda")
    for off in ("0", "off", "False", "no"):
        monkeypatch.setenv("GRADSYNC_BUCKET_TUNING", off)
        assert not caps.tuning_enabled(None) and caps.tuning_enabled("auto")
        assert caps.tuning_enabled(None, "cpu", switch=True)  # the constructor's switch wins over the variable
    monkeypatch.setenv("GRADSYNC_BUCKET_TUNING", "1")
    assert not caps.tuning_enabled(None, "cpu", switch=False) and not caps.tuning_enabled(25, "cpu", switch=True)
    monkeypatch.setenv("GRADSYNC_BUCKET_TUNING", "maybe")
    with pytest.raises(gradsync.GradsyncError, match="GRADSYNC_BUCKET_TUNING='maybe' is not a boolean"):
        caps.tuning_enabled(None)


def test_the_constructor_switches_parse_once_into_one_value(group_of_one: None, monkeypatch) -> None:
    monkeypatch.setenv("GRADSYNC_BUCKET_TUNING", "1")
    monkeypatch.setenv("GRADSYNC_DEBUG", "0")
    model = gradsync.DistributedDataParallel(
        torch.nn.Linear(4, 4), bucket_cap_mb_list=[1, 2], bucket_tuning=False, check_desync=True
    )
    config = model._config
    assert config.caps.limits == (MIB, 2 * MIB) and not config.caps.tune and config.check_desync
    assert model.communicator.check_desync  # the communicator takes the parsed switch, not the variable
    asked = ({"bucket_cap_mb_list": [1, 2]}, {}, {"bucket_cap_mb": 3}, {"bucket_cap_mb": 4, "bucket_cap_mb_list": [2]})
    for kwargs in asked:
        ours = gradsync.DistributedDataParallel(torch.nn.Linear(4, 4), **kwargs)
        theirs = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4), **kwargs)
        for name in ("bucket_bytes_cap", "bucket_bytes_cap_list", "bucket_bytes_cap_default"):
            assert getattr(ours, name) == getattr(theirs, name), (kwargs, name)


def test_trial_alternates_and_keeps_only_a_measured_gain() -> None:
    proposed, default = [MIB // 2, MIB // 2], list(DEFAULT)
    trial = Trial(proposed, default, pairs=3)
    seen = []
    for seconds in (0.9, 1.0, 0.95, 1.0, 2.0, 1.0):  # one outlier under the proposal: the median ignores it
        seen.append(trial.next_limits())
        trial.add(0.0, seconds)  # the host clock's marks: start and end of the step
    assert seen == [proposed, default] * 3 and trial.complete
    result = trial.result(HostClock())
    assert result.pairs == 3 and result.ratio == pytest.approx(0.95) and result.kept
    assert "measured 0.950x over 3 paired steps" in result.describe()
    slower = Trial(proposed, default, pairs=2)
    for seconds in (1.0, 1.0, 0.99, 1.0):  # 0.995x: within this machine's noise, not a gain
        slower.add(0.0, seconds)
    assert not slower.result(HostClock()).kept


STEPS = 5


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(64, 64) for _ in range(8)])  # 8 x 16.6 KB of gradients


def _data(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 64, generator=g), torch.randn(4, 64, generator=g)


def _tuned(rank: int, world_size: int, keep_on_rank0: bool) -> dict:
    # Each rank would decide differently (rank 0: propose 16 KiB buckets; rank 1: keep the default); rank 0's
    # proposal is tried for one pair of steps, and rank 0's verdict on the measurement is what every rank applies.
    rebuild.TRIAL_PAIRS = 1
    autotune.CANDIDATE_CAPS_MB = (1 / 64,)  # configuration: the same everywhere (it decides whether all probe)
    if rank == 0:
        autotune.MIN_GAIN = -1e9  # always propose
        rebuild.KEEP_MARGIN = -1e9 if keep_on_rank0 else 1e9
    else:
        autotune.MIN_GAIN = 2.0  # never propose
        rebuild.KEEP_MARGIN = 1e9 if keep_on_rank0 else -1e9
    model = _model()
    ddp = gradsync.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    layouts = []
    for step in range(STEPS):
        x, y = _data(step, rank)
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        layouts.append(len(ddp.reducer.buckets))
    everyone = [None] * world_size
    dist.all_gather_object(everyone, [b.param_indices for b in ddp.reducer.buckets])
    described = ddp.reducer.tuning.describe()  # the caps that apply here, rank 0's, whatever this rank preferred
    state = {k: v.clone() for k, v in model.state_dict().items()}
    return {"final": everyone, "per_step": layouts, "state": state, "tuning": described}


def _reference_state() -> dict:
    reference = _model()
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(STEPS):
        batches = [_data(step, r) for r in range(2)]
        x = torch.cat([b[0] for b in batches])
        y = torch.cat([b[1] for b in batches])
        opt.zero_grad()
        nn.functional.mse_loss(reference(x), y).backward()
        opt.step()
    return reference.state_dict()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("keep", [True, False])
def test_ranks_try_rank0s_proposal_and_apply_rank0s_verdict(keep: bool) -> None:
    results = spawn(_tuned, args=(keep,), timeout=80)
    final = results[0]["final"]
    assert final[0] == final[1]
    # Step 1: torch's first layout (one bucket); steps 2 and 3: the proposal (8 buckets of 16 KiB, one layer each)
    # and torch's caps in the observed order, alternated; from step 4 on: rank 0's verdict.
    expected_final = 8 if keep else 1
    assert all(r["per_step"] == [1, 8, 1, expected_final, expected_final] for r in results), results
    assert len(final[0]) == expected_final
    verdict = "kept" if keep else "rejected"
    for r in results:
        assert r["tuning"].startswith(f"bucket cap {0.015625 if keep else 25:g} MiB"), r["tuning"]
        assert "0.015625 MiB proposed" in r["tuning"] and "paired steps" in r["tuning"] and verdict in r["tuning"]
    for result in results:
        for name, value in _reference_state().items():
            torch.testing.assert_close(result["state"][name], value, rtol=0, atol=1e-5)
