"""torch's ``delay_all_reduce_named_params`` / ``param_to_hook_all_reduce``: two gloo ranks against torch's DDP
with the same arguments and against a single-process reference (both ranks' batches in one process), every step's
gradients and parameters within 1e-6; and each way to misuse them refused by name.

torch never waits for its delayed all-reduce; on gloo its result is read here after a barrier (gloo's barrier waits
for the work in flight), which is what NCCL's stream order gives torch's users on a GPU."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import gradsync
from gradsync.errors import ConfigError
from gradsync.testing import spawn

WORLD = 2
LR = 0.1


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(6, 8)
        self.middle = nn.Linear(8, 8)
        self.last = nn.Linear(8, 3)
        self.side = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, use_side: bool = True) -> torch.Tensor:
        h = torch.tanh(self.middle(torch.tanh(self.first(x))))
        return self.last(h) + self.side(h) if use_side else self.last(h)


def _x(rank: int, step: int, micro: int) -> torch.Tensor:
    return torch.randn(5, 6, generator=torch.Generator().manual_seed(100 * step + 10 * rank + micro))


@dataclasses.dataclass(frozen=True)
class Case:
    delayed: tuple[str, ...] = ("last.weight", "last.bias", "middle.weight")  # their gradients come before first's
    hook: str = "first.weight"
    ddp: tuple[tuple[str, Any], ...] = ()
    micro: int = 1  # backward passes a step, all but the last under no_sync
    side_skipped_on: int | None = None  # this rank's forwards skip the side branch (find_unused_parameters)
    steps: int = 3


CASES = {
    "some": Case(),
    "all": Case(delayed=tuple(n for n, _ in Net().named_parameters()), hook="first.weight"),
    "hook-is-delayed": Case(delayed=("last.weight", "first.weight"), hook="first.weight"),
    "no_sync": Case(micro=3, ddp=(("bucket_cap_mb", 0.0001),)),
    "find-unused": Case(ddp=(("find_unused_parameters", True),), side_skipped_on=1),
    "static-graph": Case(ddp=(("static_graph", True),)),
    "bucket-view": Case(ddp=(("gradient_as_bucket_view", True), ("bucket_cap_mb", 0.0001))),
}


def _wrap(cls: type, model: nn.Module, case: Case) -> nn.Module:
    named = dict(model.named_parameters())
    return cls(
        model,
        delay_all_reduce_named_params=[(n, named[n]) for n in case.delayed],
        param_to_hook_all_reduce=named[case.hook],
        **dict(case.ddp),
    )


def _train(ddp: nn.Module, rank: int, case: Case, barrier: bool) -> list[dict[str, torch.Tensor]]:
    """Each step's averaged gradients, then the parameters after all steps."""
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    seen = []
    for step in range(case.steps):
        opt.zero_grad()
        for micro in range(case.micro):
            sync = micro == case.micro - 1
            with ddp.no_sync() if not sync else contextlib.nullcontext():
                ddp(_x(rank, step, micro), use_side=rank != case.side_skipped_on).pow(2).mean().backward()
            if barrier:
                dist.barrier()  # torch's delayed all-reduce is never waited for (see the module's docstring)
        seen.append({n: p.grad.clone() for n, p in ddp.module.named_parameters() if p.grad is not None})
        opt.step()
    seen.append({n: p.detach().clone() for n, p in ddp.module.named_parameters()})
    return seen


def _reference(case: Case) -> list[dict[str, torch.Tensor]]:
    """One process, both ranks' batches: the mean of each rank's mean loss, so the same gradients as the average."""
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    seen = []
    for step in range(case.steps):
        opt.zero_grad()
        for rank in range(WORLD):
            for micro in range(case.micro):
                out = model(_x(rank, step, micro), use_side=rank != case.side_skipped_on)
                (out.pow(2).mean() / WORLD).backward()
        seen.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
    seen.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return seen


def _run_cases(rank: int, world: int) -> dict[str, dict[str, list]]:
    results = {}
    for name, case in CASES.items():
        ours = _train(_wrap(gradsync.DistributedDataParallel, Net(), case), rank, case, barrier=False)
        try:
            torchs: Any = _train(_wrap(TorchDDP, Net(), case), rank, case, barrier=True)
        except ValueError as exc:  # torch 2.13 cannot wrap a model whose every parameter is delayed
            torchs = str(exc)
        results[name] = {"ours": ours, "torch": torchs}
    return results


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_delayed_parameters_match_torch_and_one_process() -> None:
    per_rank = spawn(_run_cases, WORLD, timeout=240)
    for name, case in CASES.items():
        ref = _reference(case)
        for rank in range(WORLD):
            ours, torchs = per_rank[rank][name]["ours"], per_rank[rank][name]["torch"]
            for step, (o, r) in enumerate(zip(ours, ref)):
                assert _close(o, r) < 1e-6, (name, rank, step)
            if name == "all":
                assert "must be on the same type of devices" in torchs
                continue
            if case.hook in case.delayed:
                # torch's average misses the hook parameter's own gradient (its tensor hook runs before the
                # gradient is accumulated): the first step's other gradients agree, that one does not.
                others = [k for k in ours[0] if k != case.hook]
                assert _close({k: ours[0][k] for k in others}, {k: torchs[0][k] for k in others}) < 1e-6, name
                assert (ours[0][case.hook] - torchs[0][case.hook]).abs().max() > 1e-3, name
                continue
            for step, (o, t) in enumerate(zip(ours, torchs)):
                assert _close(o, t) < 1e-6, (name, rank, step)
        assert _close(per_rank[0][name]["ours"][-1], per_rank[1][name]["ours"][-1]) == 0.0, name


def _ddp(model: nn.Module, delayed: list, hook: Any, **kwargs: Any) -> gradsync.DistributedDataParallel:
    return gradsync.DistributedDataParallel(
        model, delay_all_reduce_named_params=delayed, param_to_hook_all_reduce=hook, **kwargs
    )


def test_misuse_is_refused_by_name(group_of_one: None) -> None:
    m = Net()
    with pytest.raises(ValueError, match="need to be set at the same time"):
        gradsync.DistributedDataParallel(m, param_to_hook_all_reduce=m.first.weight)
    with pytest.raises(ValueError, match="need to be set at the same time"):
        gradsync.DistributedDataParallel(m, delay_all_reduce_named_params=list(m.last.named_parameters()))
    with pytest.raises(ConfigError, match="'weight'.*not a \\(name, parameter\\) pair"):
        _ddp(m, list(m.last.named_parameters()), m.first.weight)  # names without the module's prefix
    with pytest.raises(ConfigError, match="list of \\(name, parameter\\) pairs"):
        _ddp(m, "last.weight", m.first.weight)
    with pytest.raises(ConfigError, match="names 'last.bias' twice"):
        _ddp(m, [("last.bias", m.last.bias)] * 2, m.first.weight)
    with pytest.raises(ConfigError, match="param_to_hook_all_reduce must be one of the wrapped module's"):
        _ddp(m, [("last.bias", m.last.bias)], nn.Parameter(torch.ones(1)))
    half = Net()
    half.last.bfloat16()
    with pytest.raises(ConfigError, match="'last.weight' is torch.bfloat16.*one dtype"):
        _ddp(half, [("middle.bias", half.middle.bias), ("last.weight", half.last.weight)], half.first.weight)
    with pytest.raises(ConfigError, match="delay_all_reduce_named_params"):
        _ddp(m, [("last.bias", m.last.bias)], m.first.weight, mixed_precision=gradsync.MixedPrecision(torch.bfloat16))
    sparse = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2))
    with pytest.raises(ConfigError, match="'0.weight' has sparse gradients"):
        _ddp(sparse, [("0.weight", sparse[0].weight)], sparse[1].weight)
    ddp = _ddp(m, [("last.bias", m.last.bias)], m.first.weight)
    with pytest.raises(ConfigError, match="join\\(\\) with delay_all_reduce_named_params"):
        ddp.join()
    assert _ddp(Net(), [], Net().first.weight).reducer is not None  # an empty list: nothing delayed, as in torch


def test_a_delayed_gradient_after_the_hook_parameters_is_refused(group_of_one: None) -> None:
    m = Net()
    ddp = _ddp(m, [("first.weight", m.first.weight)], m.last.weight)  # last's gradient comes first
    with pytest.raises(ConfigError, match="'first.weight' got their gradient after param_to_hook_all_reduce's"):
        ddp(_x(0, 0, 0)).sum().backward()


class Skippable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, use_a: bool = True) -> torch.Tensor:
        return self.b(self.a(x) if use_a else x)


def test_a_backward_without_the_hook_parameter_is_refused(group_of_one: None) -> None:
    m = Skippable()
    ddp = _ddp(m, [("b.weight", m.b.weight)], m.a.weight, find_unused_parameters=True)  # a's gradient comes after
    ddp(torch.ones(2, 4)).sum().backward()
    with pytest.raises(ConfigError, match="but not param_to_hook_all_reduce's, so they were never averaged"):
        ddp(torch.ones(2, 4), use_a=False).sum().backward()


def test_a_copy_and_no_sync_keep_the_delayed_gradients_in_the_buffer(group_of_one: None) -> None:
    m = Net()
    ddp = _ddp(m, [("last.weight", m.last.weight)], m.first.weight)
    twin = copy.deepcopy(ddp)
    for model in (ddp, twin):
        with model.no_sync():
            model(_x(0, 0, 0)).sum().backward()
        model(_x(0, 0, 1)).sum().backward()
        assert model.module.last.weight.grad.data_ptr() == model._delayed.buffer.data_ptr()
    assert torch.equal(ddp.module.last.weight.grad, twin.module.last.weight.grad)
