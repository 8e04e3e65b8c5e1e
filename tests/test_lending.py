"""Write-back by lending (gradsync/reducer/lending.py): a large gradient's averages reach ``.grad`` by pointing it at
its bucket slot instead of copying, and only where nobody can tell: every step equals torch's DDP bit for bit, a
gradient kept across steps keeps its values, and a gradient (or a view of one) that stays in use gets torch's
copy-back from then on."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch import nn

import gradsync
from gradsync.reducer.lending import Lending, Verdict, lend
from gradsync.testing import spawn
from gradsync.torch_private.storage import can_count_storage_uses

pytestmark = pytest.mark.skipif(not can_count_storage_uses(), reason="this torch cannot count a storage's users")


def _model() -> nn.Module:
    torch.manual_seed(0)
    # Two weights of 8,192 values (lent), the rest small (copied back in one fused copy).
    return nn.Sequential(nn.Linear(16, 512), nn.Tanh(), nn.Linear(512, 16), nn.Tanh(), nn.Linear(16, 3))


def _pair() -> tuple[nn.Module, nn.Module]:
    model = _model()
    reference = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model), bucket_cap_mb=0.02)
    return gradsync.DistributedDataParallel(model, bucket_cap_mb=0.02), reference


def _step(nets: tuple[nn.Module, ...], rank: int, step: int) -> None:
    for net in nets:
        torch.manual_seed(100 * step + rank)
        net(torch.randn(4, 16)).pow(2).mean().backward()


def _same(ddp: nn.Module, reference: nn.Module) -> bool:
    return all(torch.equal(a.grad, b.grad) for a, b in zip(ddp.parameters(), reference.parameters()))


def _lent(ddp: gradsync.DistributedDataParallel) -> list[bool]:
    """Which parameters' ``.grad`` lives in the buckets' storage."""
    storages = {t.untyped_storage().data_ptr() for t in ddp.reducer.layout.storage.values()}
    return [p.grad.untyped_storage().data_ptr() in storages for p in ddp.module.parameters()]


def _usual_loop(rank: int, world_size: int) -> dict:
    ddp, reference = _pair()
    optimizers = [torch.optim.SGD(net.parameters(), lr=0.01) for net in (ddp, reference)]
    same, lent = [], []
    for step in range(5):
        for opt in optimizers:
            opt.zero_grad()  # set_to_none=True: each backward's .grad is fresh
        _step((ddp, reference), rank, step)
        same.append(_same(ddp, reference))
        lent.append(_lent(ddp))
        for opt in optimizers:
            opt.step()
    return {"same": same, "lent": lent}


@pytest.mark.timeout(60)
def test_the_usual_loop_lends_the_large_slots_and_equals_torch() -> None:
    for result in spawn(_usual_loop, timeout=50):
        assert result["same"] == [True] * 5
        # From the step after the rebuild, the two large weights' .grad are their slots; nothing else is lent.
        assert result["lent"][0] == [False] * 6
        assert result["lent"][2:] == [[True, False, True, False, False, False]] * 3


def _kept_across_steps(rank: int, world_size: int) -> dict:
    ddp, reference = _pair()
    for step in range(3):  # past the rebuild: the large slots are lent
        ddp.zero_grad()
        reference.zero_grad()
        _step((ddp, reference), rank, step)
    kept = [p.grad for p in ddp.module.parameters()]
    values = [g.clone() for g in kept]
    same = []
    for step in range(3, 6):
        ddp.zero_grad()
        reference.zero_grad()
        _step((ddp, reference), rank, step)
        same.append(_same(ddp, reference))
    unchanged = all(torch.equal(g, v) for g, v in zip(kept, values))
    return {"same": same, "unchanged": unchanged, "lent": _lent(ddp)}


@pytest.mark.timeout(60)
def test_a_gradient_kept_across_steps_keeps_its_values() -> None:
    for result in spawn(_kept_across_steps, timeout=50):
        assert result["unchanged"]  # the next backward wrote into a storage of its own
        assert result["same"] == [True] * 3
        assert result["lent"] == [False] * 6  # having moved, the buckets copy back, as torch's


def _grads_kept_in_place(rank: int, world_size: int) -> dict:
    # zero_grad(set_to_none=False) and no_sync: .grad lives on across steps, and a view of it, made once, must see
    # every later step's averages, as with torch's DDP (which copies into the same .grad each step).
    ddp, reference = _pair()
    views: dict[str, torch.Tensor] = {}
    same, seen, lent = [], [], []
    for step in range(5):
        for net in (ddp, reference):
            net.zero_grad(set_to_none=False)
        if step == 3:
            with ddp.no_sync(), reference.no_sync():
                _step((ddp, reference), rank, 99)
        _step((ddp, reference), rank, step)
        if step == 0:  # before the rebuild: .grad is autograd's tensor, and this view shares its memory
            views = {name: net.module[0].weight.grad.view(-1) for name, net in (("ours", ddp), ("torch", reference))}
        same.append(_same(ddp, reference))
        lent.append(any(_lent(ddp)))
        if views:
            seen.append(torch.equal(views["ours"], views["torch"]))
    return {"same": same, "seen": seen, "lent": lent}


@pytest.mark.timeout(60)
def test_gradients_kept_in_place_see_every_step_as_with_torch() -> None:
    for result in spawn(_grads_kept_in_place, timeout=50):
        assert result["same"] == [True] * 5
        assert result["seen"] == [True] * 5
        assert result["lent"] == [False] * 5  # a loop that keeps its gradients lends nothing: no trade, no move


def test_a_loan_still_held_moves_the_buckets_once_then_copies() -> None:
    storage = [torch.zeros(8)]
    lending = Lending()
    assert lending.before_step(storage) is Verdict.LEND  # the baseline: nothing lent yet
    assert lending.before_step(storage) is Verdict.LEND
    held = storage[0][:4]  # a lent slot someone kept
    assert lending.before_step(storage) is Verdict.MOVE
    del held
    assert lending.before_step(storage) is Verdict.COPY  # given up for good: no storage flips back and forth


def _switched_off(rank: int, world_size: int) -> dict:
    os.environ["GRADSYNC_LENDING"] = "0"  # in the rank: the forkserver's environment is from before the test
    ddp, reference = _pair()
    same, lent = [], []
    for step in range(4):
        ddp.zero_grad()
        reference.zero_grad()
        _step((ddp, reference), rank, step)
        same.append(_same(ddp, reference))
        lent.append(any(_lent(ddp)))
    return {"same": same, "lent": lent}


@pytest.mark.timeout(60)
def test_gradsync_lending_0_copies_back_as_torch_does() -> None:
    for result in spawn(_switched_off, timeout=50):
        assert result["same"] == [True] * 4
        assert result["lent"] == [False] * 4


def test_only_a_gradient_nothing_else_holds_is_lent() -> None:
    slots = torch.arange(12.0).split(4)
    own = torch.zeros(4)
    base = torch.zeros(8)
    cut = base[:4]  # shares its memory with base
    needs_grad = torch.zeros(4, requires_grad=True)
    grads = [own, cut, needs_grad.detach().requires_grad_()]
    with torch.no_grad():
        lend(grads, slots)
    assert own.untyped_storage().data_ptr() == slots[0].untyped_storage().data_ptr()  # lent
    assert cut.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()  # copied into
    assert grads[2].untyped_storage().data_ptr() != slots[2].untyped_storage().data_ptr()
    assert [g.tolist() for g in grads] == [s.tolist() for s in slots]
