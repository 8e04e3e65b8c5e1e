"""Write-back by lending (gradsync/reducer/buckets.py): a large gradient's averages reach ``.grad`` by pointing it at
its bucket slot instead of copying, and only where nobody can tell: every step equals torch's DDP bit for bit, a
gradient kept across steps keeps its values, and a gradient (or a view of one) that stays in use gets torch's
copy-back from then on."""

from __future__ import annotations

import copy
import functools
import io
import itertools
import os
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import gradsync
from gradsync.reducer.buckets import Lending, LendingChoice, lend
from gradsync.testing import spawn
from gradsync.torch_private.storage import can_count_storage_uses

pytestmark = pytest.mark.skipif(not can_count_storage_uses(), reason="this torch cannot count a storage's users")


def _model() -> nn.Module:
    torch.manual_seed(0)
    # Two weights of 65,536 values (256 KiB: large, lent), the rest small (copied back in one fused copy).
    return nn.Sequential(nn.Linear(16, 4096), nn.Tanh(), nn.Linear(4096, 16), nn.Tanh(), nn.Linear(16, 3))


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
    assert lending.before_step(storage) is LendingChoice.LEND  # the baseline: nothing lent yet
    assert lending.before_step(storage) is LendingChoice.LEND
    held = storage[0][:4]  # a lent slot someone kept
    assert lending.before_step(storage) is LendingChoice.MOVE
    del held
    assert lending.before_step(storage) is LendingChoice.COPY  # given up for good: no storage flips back and forth


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


def _fresh_gradient(n: int = 4) -> torch.nn.Parameter:
    """A parameter whose ``.grad`` autograd just made: what lending sees in the usual loop."""
    param = torch.nn.Parameter(torch.zeros(n))
    (param * 2).sum().backward()
    return param


def test_only_a_gradient_nothing_else_holds_is_lent() -> None:
    slots = torch.arange(12.0).split(4)
    own, cut, needs_grad = _fresh_gradient(), _fresh_gradient(), _fresh_gradient()
    base = torch.zeros(8)
    cut.grad = base[:4]  # shares its memory with base
    needs_grad.grad = torch.zeros(4, requires_grad=True)
    with torch.no_grad():
        lend([own, cut, needs_grad], slots)
    grads = [own.grad, cut.grad, needs_grad.grad]
    assert own.grad.untyped_storage().data_ptr() == slots[0].untyped_storage().data_ptr()  # lent
    assert cut.grad.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()  # copied into
    assert needs_grad.grad.untyped_storage().data_ptr() != slots[2].untyped_storage().data_ptr()
    assert [g.tolist() for g in grads] == [s.tolist() for s in slots]  # type: ignore[union-attr]


# Every way a gradient's memory can be shared or exported in a hook, with how to read what the alias sees. Each is
# either detected (the gradient is copied into, as torch's reducer does, and the alias sees the averages) or is no
# alias (a weak reference; a copy). ``lent`` says which lending does.
# Not here, because nothing can detect them: a raw data_ptr() an extension keeps, a CUDA graph that captured the
# address (docs/migrating.md says to set GRADSYNC_LENDING=0 there); __array_interface__ (torch tensors have none) and
# __cuda_array_interface__ (CUDA only; on CPU it raises).
def _saved(g: torch.Tensor) -> bytes:
    buffer = io.BytesIO()
    torch.save(g, buffer)
    return buffer.getvalue()


def _loaded(saved: bytes) -> torch.Tensor:
    return torch.load(io.BytesIO(saved))


def _dereferenced(ref: weakref.ref) -> torch.Tensor:
    tensor = ref()  # a tensor hook's incoming gradient may be gone, under either framework
    return torch.empty(0) if tensor is None else tensor


def _storage_of(g: torch.Tensor) -> tuple[torch.UntypedStorage, int, torch.Size]:
    return g.untyped_storage(), g.storage_offset(), g.shape  # a lent .grad's storage is its bucket layout's


def _through_storage(kept: tuple[torch.UntypedStorage, int, torch.Size]) -> torch.Tensor:
    return torch.empty(0).set_(*kept)  # type: ignore[call-overload]


ALIASES: dict[str, tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor], bool]] = {
    "the tensor itself": (lambda g: g, lambda a: a, False),  # as a __cuda_array_interface__ consumer keeps it
    "a weak reference": (weakref.ref, _dereferenced, True),
    "torch.save": (_saved, _loaded, True),  # a copy: the local gradient under either framework
    "a view": (lambda g: g.view(2, -1), lambda a: a, False),
    "detach()": (lambda g: g.detach(), lambda a: a, False),
    ".data": (lambda g: g.data, lambda a: a, False),
    ".numpy()": (lambda g: g.numpy(), torch.from_numpy, False),
    "np.asarray": (np.asarray, torch.from_numpy, False),
    "memoryview": (lambda g: memoryview(g.numpy()), lambda a: torch.frombuffer(a, dtype=torch.float32), False),
    "torch.from_dlpack": (torch.from_dlpack, lambda a: a, False),
    "np.from_dlpack": (np.from_dlpack, torch.from_numpy, False),
    "a DLPack capsule": (torch.utils.dlpack.to_dlpack, torch.utils.dlpack.from_dlpack, False),
    "untyped_storage()": (_storage_of, _through_storage, False),
    "share_memory_()": (lambda g: g.share_memory_(), lambda a: a, False),
}


@pytest.mark.parametrize("kind", list(ALIASES))
def test_an_alias_is_detected_or_sees_the_averages(kind: str) -> None:
    keep, read, lent = ALIASES[kind]
    param = torch.nn.Parameter(torch.zeros(4))
    kept: list = []
    param.register_post_accumulate_grad_hook(lambda p: kept.append(keep(p.grad)))
    (param * 2).sum().backward()
    slot = torch.arange(8.0)[4:]  # the averages, in a bucket's storage
    local = param.grad.clone()  # a capsule is read once: not before lending
    with torch.no_grad():
        lend([param], [slot])
    assert (param.grad.untyped_storage().data_ptr() == slot.untyped_storage().data_ptr()) == lent
    assert torch.equal(param.grad, slot)
    expected = local if kind == "torch.save" else slot  # torch's DDP copies the averages into .grad
    assert torch.equal(read(kept[0]).reshape(-1), expected)


def _keep_alias(keep: Callable[[torch.Tensor], Any], kept: list, param: torch.Tensor) -> None:
    kept.append(keep(param.grad))  # type: ignore[arg-type]


def _keep_incoming(keep: Callable[[torch.Tensor], Any], kept: list, grad: torch.Tensor) -> None:
    kept.append(keep(grad))


def _aliases_against_torch(rank: int, world_size: int) -> dict:
    # The case and its kin: a post-accumulate hook keeps an alias of a large weight's .grad (lent from the
    # step after the rebuild on). Under torch's DDP the averages are copied into that .grad, so the alias sees them.
    # A tensor hook's alias of the incoming gradient: autograd then accumulates a copy of it, under either.
    found = {}
    for hook, (kind, (keep, read, _lent)) in itertools.product(("post_accumulate", "tensor"), ALIASES.items()):
        nets = _pair()
        kept: dict[int, list] = {0: [], 1: []}
        for k, net in enumerate(nets):
            weight = net.module[0].weight
            if hook == "tensor":
                weight.register_hook(functools.partial(_keep_incoming, keep, kept[k]))
            else:
                weight.register_post_accumulate_grad_hook(functools.partial(_keep_alias, keep, kept[k]))
        seen, same = [], []
        for step in range(4):
            for net in nets:
                net.zero_grad()
            _step(nets, rank, step)
            seen.append(torch.equal(read(kept[0][-1]).reshape(-1), read(kept[1][-1]).reshape(-1)))
            same.append(_same(*nets))
        found[f"{hook}: {kind}"] = {"seen": seen, "same": same}
    return found


@pytest.mark.timeout(120)
def test_a_hook_that_keeps_an_alias_of_the_gradient_sees_what_torch_gives() -> None:
    for result in spawn(_aliases_against_torch, timeout=110):
        wrong = {kind: r for kind, r in result.items() if r != {"seen": [True] * 4, "same": [True] * 4}}
        assert not wrong, wrong


def _alias_after_backward(rank: int, world_size: int) -> dict:
    # An alias of a lent .grad made after backward keeps that step's values through the next steps, as under torch's
    # DDP (where zero_grad lets go of the old .grad and the alias keeps it): the buckets move off the held storage.
    found = {}
    for kind in ("torch.from_dlpack", "np.from_dlpack", ".numpy()", "a view", "untyped_storage()"):
        keep, read, _lent = ALIASES[kind]
        nets = _pair()
        kept, values, same = [], [], []
        for step in range(5):
            for net in nets:
                net.zero_grad()
            _step(nets, rank, step)
            same.append(_same(*nets))
            if step == 2:
                kept = [keep(net.module[0].weight.grad) for net in nets]
                values = [net.module[0].weight.grad.clone() for net in nets]
        still = [torch.equal(read(a).reshape(-1), v.reshape(-1)) for a, v in zip(kept, values)]
        found[kind] = {"same": same, "kept": still}
    return found


@pytest.mark.timeout(120)
def test_an_alias_made_after_backward_keeps_its_step_as_with_torch() -> None:
    for result in spawn(_alias_after_backward, timeout=110):
        wrong = {kind: r for kind, r in result.items() if r != {"same": [True] * 5, "kept": [True, True]}}
        assert not wrong, wrong
