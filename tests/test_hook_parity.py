"""A parameter's own hooks see and change what they would under torch's DDP: tensor hooks (``register_hook``) and
post-accumulate-grad hooks, registered before or after wrapping, observing or changing the gradient, on every kind
of parameter (lent, bucketed and copied back, sparse, unused), in every graph mode and with gradient_as_bucket_view.

torch's reducer hooks each parameter's gradient accumulator (a post hook of its AccumulateGrad node), which autograd
runs after the parameter's post-accumulate-grad hooks, whenever they were registered: a hook that scales ``.grad`` in
place is averaged. gradsync's reducer hooks the same node (gradsync/reducer/reducer.py). Every case of a mode runs in
one spawn; a case reports its differences from torch (and any exception) instead of raising, so one failing case
names itself without hiding the others."""

from __future__ import annotations

import itertools
import os
import traceback
from collections.abc import Callable

import pytest
import torch
from torch import nn

import gradsync
from gradsync.testing import spawn

STEPS = 4  # iteration 1 records the ready order; the rebuild, lending and quiet hooks follow
WHEN = ("before", "after")  # hooks registered before or after wrapping in DistributedDataParallel
HOOKS = ("tensor", "post_accumulate")
ACTIONS = ("observe", "change")


class Net(nn.Module):
    """A sparse embedding, a 8,192-value weight (its averages are lent to .grad), small parameters (gathered and
    copied back), and, where the graph mode allows it, a layer no forward uses."""

    def __init__(self, with_unused: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(40, 16, sparse=True)
        self.wide = nn.Linear(16, 512)
        self.narrow = nn.Linear(512, 3)
        self.unused = nn.Linear(16, 3) if with_unused else None

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.narrow(torch.tanh(self.wide(self.embed(idx).mean(1))))


def _dense(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    return (t.to_dense() if t.is_sparse else t).detach().clone()


def _install(model: nn.Module, hook: str, action: str, seen: list) -> None:
    """The user's hooks, one per parameter: record what arrives, and, for "change", scale it."""
    for name, p in model.named_parameters():
        if hook == "tensor":

            def tensor_hook(g: torch.Tensor, name: str = name) -> torch.Tensor | None:
                seen.append((name, _dense(g)))
                return g * 3.0 if action == "change" else None

            p.register_hook(tensor_hook)
        else:

            def post_hook(param: torch.Tensor, name: str = name) -> None:
                seen.append((name, _dense(param.grad)))
                if action == "change" and param.grad is not None:
                    param.grad.mul_(0.5)

            p.register_post_accumulate_grad_hook(post_hook)


def _wrap(
    framework: str, model: nn.Module, mode: str, when: str, hook: str, action: str, seen: list, cap_mb: float = 0.02
) -> nn.Module:
    if when == "before":
        _install(model, hook, action, seen)
    kwargs = {"find_unused_parameters": mode == "find_unused", "static_graph": mode == "static"}
    kwargs["gradient_as_bucket_view"] = mode == "bucket_view"
    kwargs["bucket_cap_mb"] = cap_mb
    if framework == "torch":
        ddp = torch.nn.parallel.DistributedDataParallel(model, **kwargs)
    else:
        ddp = gradsync.DistributedDataParallel(model, **kwargs)
    if when == "after":
        _install(model, hook, action, seen)
    return ddp


def _run(framework: str, rank: int, mode: str, when: str, hook: str, action: str) -> dict:
    torch.manual_seed(0)
    model = Net(with_unused=mode in ("find_unused", "static"))
    seen: list = []
    ddp = _wrap(framework, model, mode, when, hook, action, seen)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    for step in range(STEPS):
        opt.zero_grad()
        torch.manual_seed(100 * step + rank)
        ddp(torch.randint(0, 40, (6, 5))).pow(2).mean().backward()
        grads.append([_dense(p.grad) for p in model.parameters()])
        opt.step()
    return {"seen": seen, "grads": grads, "params": [p.detach().clone() for p in model.parameters()]}


def _difference(a: object, b: object) -> float:
    """The largest difference between two nests of tensors (inf where their shapes or Nones differ)."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return (a - b).abs().max().item() if a.shape == b.shape else float("inf")
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        return max((_difference(x, y) for x, y in zip(a, b)), default=0.0)
    return 0.0 if a == b else float("inf")


def _case(rank: int, mode: str, when: str, hook: str, action: str) -> dict:
    try:
        ours, theirs = (_run(fw, rank, mode, when, hook, action) for fw in ("gradsync", "torch"))
    except Exception:
        return {"error": traceback.format_exc(limit=4)}
    return {key: _difference(ours[key], theirs[key]) for key in ("seen", "grads", "params")}


def _cases(rank: int, world_size: int, mode: str, lending: bool) -> dict:
    os.environ["GRADSYNC_LENDING"] = "1" if lending else "0"  # read when each reducer is built
    return {"/".join(case): _case(rank, mode, *case) for case in itertools.product(WHEN, HOOKS, ACTIONS)}


def _check(results: list[dict]) -> None:
    bad = {}
    for rank, result in enumerate(results):
        for case, found in result.items():
            if "error" in found or max(found.values()) > 1e-6:
                bad[f"rank {rank} {case}"] = found
    assert not bad, bad


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("mode", "lending"),
    [("all_used", True), ("all_used", False), ("find_unused", True), ("static", True), ("bucket_view", True)],
)
def test_parameter_hooks_see_and_change_what_they_would_under_torch(mode: str, lending: bool) -> None:
    _check(spawn(_cases, args=(mode, lending), timeout=280))


def _halve(param: torch.Tensor) -> None:
    param.grad.mul_(0.5)


def _scaled_after_wrapping(rank: int, world_size: int) -> list[float]:
    # The case: a post-accumulate hook that halves .grad, registered after wrapping, on a lent weight.
    result = []
    for framework in ("gradsync", "torch"):
        torch.manual_seed(0)
        model = nn.Linear(128, 64)
        make: Callable[..., nn.Module] = (
            gradsync.DistributedDataParallel if framework == "gradsync" else torch.nn.parallel.DistributedDataParallel
        )
        ddp = make(model)
        model.weight.register_post_accumulate_grad_hook(_halve)
        for step in range(3):
            model.zero_grad()
            torch.manual_seed(step + 10 * rank)
            ddp(torch.randn(4, 128)).sum().backward()
        result.append(model.weight.grad.sum().item())
    return result


@pytest.mark.timeout(60)
def test_a_hook_that_halves_the_gradient_after_wrapping_is_averaged_halved() -> None:
    for ours, torchs in spawn(_scaled_after_wrapping, timeout=50):
        assert ours == torchs


def _compiled_case(rank: int, when: str, hook: str) -> dict:
    torch._dynamo.reset()
    results = []
    for framework in ("gradsync", "torch"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 512), nn.Tanh(), nn.Linear(512, 3))
        seen: list = []
        # torch's compiled DDP (its DDPOptimizer) needs the first bucket no larger than the others: default caps.
        ddp = _wrap(framework, model, "all_used", when, hook, "change", seen, cap_mb=25.0)
        compiled = torch.compile(ddp, backend="aot_eager")
        grads = []
        for step in range(3):
            model.zero_grad()
            torch.manual_seed(step + 10 * rank)
            compiled(torch.randn(4, 16)).pow(2).mean().backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        results.append({"seen": seen, "grads": grads})
    return {key: _difference(results[0][key], results[1][key]) for key in ("seen", "grads")}


def _compiled(rank: int, world_size: int) -> dict:
    return {f"{when}/{hook}": _compiled_case(rank, when, hook) for when, hook in itertools.product(WHEN, HOOKS)}


@pytest.mark.timeout(300)
def test_hooks_of_a_compiled_model_see_and_change_what_they_would_under_torch() -> None:
    for result in spawn(_compiled, timeout=280):
        assert all(max(found.values()) <= 1e-6 for found in result.values()), result
