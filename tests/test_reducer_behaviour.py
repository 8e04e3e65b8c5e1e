"""What the reducer does besides getting the numbers right: overlap, one rebuild from rank 0's observed order,
gradients living in the buckets, and local accumulation under no_sync."""

from __future__ import annotations

import copy
import types

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gradsync
from gradsync.comm import allreduce_hook
from gradsync.testing import spawn


def _overlap(rank: int, world_size: int) -> tuple[list, int]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(6)])
    ddp = gradsync.DistributedDataParallel(model, bucket_cap_mb=0.004)  # one Linear (4.2 KB) per bucket
    events: list = []

    def recording_hook(state, bucket):
        events.append(("launch", bucket.index()))
        return allreduce_hook(state, bucket)

    ddp.register_comm_hook(dist.group.WORLD, recording_hook)
    model[0].weight.register_post_accumulate_grad_hook(lambda p: events.append(("ready", "0.weight")))
    ddp(torch.randn(4, 32)).sum().backward()  # iteration 1: one bucket, as torch (see BucketCaps.first_limits)
    first = len(ddp.reducer.buckets)
    events.clear()
    ddp(torch.randn(4, 32)).sum().backward()  # rebuilt in the ready order
    return events, (first, len(ddp.reducer.buckets))


@pytest.mark.timeout(60)
def test_buckets_launch_while_backward_still_runs() -> None:
    for events, n_buckets in spawn(_overlap, timeout=50):
        assert n_buckets == (1, 6)
        first_layer_ready = events.index(("ready", "0.weight"))
        launched_before = [e for e in events[:first_layer_ready] if e[0] == "launch"]
        # Every other layer's bucket was on the wire before backward reached the first layer (whose own bucket
        # launches after this user hook: gradsync's runs after the parameter's own hooks, as torch's does).
        assert launched_before[:5] == [("launch", k) for k in range(5)], events


class TwoBranches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x, a_first: bool):
        # Autograd runs the later-recorded branch first, so the ready order follows the forward order here.
        if a_first:
            ya = self.a(x)
            yb = self.b(x)
        else:
            yb = self.b(x)
            ya = self.a(x)
        return (ya * yb).sum()


def _rebuild(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    model = TwoBranches()
    ddp = gradsync.DistributedDataParallel(model, bucket_cap_mb=0.0002)  # one Linear per bucket
    names = ddp.reducer.names
    layout = lambda: [[names[i] for i in b.param_indices] for b in ddp.reducer.buckets]  # noqa: E731
    before = layout()
    out = {"before": before}
    for step in range(3):
        ddp(torch.randn(2, 8), a_first=(rank == 1)).backward()  # rank 0: a's grads first; rank 1: b's
        out[f"rebuilt_after_{step}"] = ddp.reducer.rebuilt
    out["after"] = layout()
    return out


@pytest.mark.timeout(60)
def test_one_rebuild_in_rank0_ready_order() -> None:
    r0, r1 = spawn(_rebuild, timeout=50)
    assert [sorted(b) for b in r0["before"]] == [["a.bias", "a.weight", "b.bias", "b.weight"]]  # one, as torch
    # Rebuilt at the second forward, from rank 0's observed order (a ran last there, so its grads came first)...
    assert [r0["rebuilt_after_0"], r0["rebuilt_after_1"], r0["rebuilt_after_2"]] == [False, True, True]
    assert [sorted(b) for b in r0["after"]] == [["a.bias", "a.weight"], ["b.bias", "b.weight"]]
    # ...and rank 1, whose own order was the opposite, built exactly the same buckets.
    assert r1["after"] == r0["after"]


def _views(rank: int, world_size: int) -> list[bool]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    ddp = gradsync.DistributedDataParallel(model, gradient_as_bucket_view=True, bucket_cap_mb=0.0003)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    shares = []
    for _ in range(3):
        opt.zero_grad(set_to_none=True)
        ddp(torch.randn(4, 8)).sum().backward()
        storages = {b.buffer.untyped_storage().data_ptr() for b in ddp.reducer.buckets}
        shares.append(all(p.grad.untyped_storage().data_ptr() in storages for p in model.parameters()))
        opt.step()
    return shares


@pytest.mark.timeout(60)
def test_grads_are_bucket_views_even_after_set_to_none() -> None:
    for shares in spawn(_views, timeout=50):
        assert shares == [True, True, True]


def _no_sync(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    model = nn.Linear(4, 1, bias=False)
    ddp = gradsync.DistributedDataParallel(model)
    x = torch.full((1, 4), float(rank + 1))
    with ddp.no_sync():
        ddp(x).sum().backward()
    local = model.weight.grad.clone()
    try:
        with ddp.no_sync():
            raise KeyError("user error inside no_sync")
    except KeyError:
        pass
    restored = ddp.require_backward_grad_sync
    ddp(x).sum().backward()
    return {"local": local.tolist(), "restored": restored, "synced": model.weight.grad.tolist()}


@pytest.mark.timeout(60)
def test_no_sync_accumulates_locally_then_averages_the_sum() -> None:
    r0, r1 = spawn(_no_sync, timeout=50)
    assert r0["local"] == [[1.0] * 4] and r1["local"] == [[2.0] * 4]  # no communication inside no_sync
    assert r0["restored"] and r1["restored"]  # restored even when the block raised
    # rank 0 accumulated 1+1, rank 1 2+2: the average of the sums is 3.
    assert r0["synced"] == r1["synced"] == [[3.0] * 4]


def _largest_difference(model: nn.Module, reference: nn.Module) -> float:
    return max((a.grad - b.grad).abs().max().item() for a, b in zip(model.parameters(), reference.parameters()))


def _loud_hooks(model: nn.Module) -> int:
    """Parameters whose gradient hook runs Python: a quiet one's is its bucket's ``heard.append``, a C method
    registered as a post-accumulate-grad hook; a loud one's is a post hook of its gradient accumulator."""
    return sum(
        not any(isinstance(h, types.BuiltinMethodType) for h in (p._post_accumulate_grad_hooks or {}).values())
        for p in model.parameters()
    )


def _quiet_hooks(rank: int, world_size: int, view: bool, static: bool) -> dict:
    # 40 small parameters and one large one; after the rebuild only each bucket's last-ready parameter (and, with
    # gradient_as_bucket_view, the large one) runs a Python hook, and the averages still equal torch's DDP's.
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(20)], nn.Linear(8, 1024), nn.Linear(1024, 1))
    kwargs = {"static_graph": static, "gradient_as_bucket_view": view}
    reference = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model), **kwargs)
    ddp = gradsync.DistributedDataParallel(model, bucket_cap_mb=0.001, **kwargs)
    loud, diffs = [], []
    for step in range(4):
        for net in (ddp, reference):
            torch.manual_seed(10 * step + rank)
            if step == 2:  # accumulation under no_sync still works with the quiet parameters
                with net.no_sync():
                    net(torch.randn(4, 8)).pow(2).mean().backward()
            torch.manual_seed(10 * step + rank)
            net(torch.randn(4, 8)).pow(2).mean().backward()
        loud.append(_loud_hooks(model))
        diffs.append(_largest_difference(model, reference))
        for net in (ddp, reference):
            net.zero_grad()
    kept = len(ddp.reducer.params) - ddp.reducer.quiet_parameters()
    return {"loud": loud, "kept": kept, "buckets": len(ddp.reducer.buckets), "diffs": diffs}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("view", [False, True])
@pytest.mark.parametrize("static", [False, True])
def test_one_python_hook_per_bucket_once_the_ready_order_is_known(view: bool, static: bool) -> None:
    for result in spawn(_quiet_hooks, args=(view, static), timeout=50):
        n_params, kept = 44, result["kept"]
        # Iteration 1 records the ready order (static_graph: learns the graph, and iteration 2 records), with every
        # hook; the rebuild at the next forward makes the others quiet.
        loud_until = 2 if static else 1
        assert result["loud"] == [n_params] * loud_until + [kept] * (4 - loud_until), result
        assert kept == result["buckets"] < n_params // 2, result  # one per bucket
        assert result["diffs"] == [0.0] * 4, result  # 2 ranks: bit for bit


class _Swapped(nn.Module):
    """Two layers whose gradients become ready in one order or the other, as the forward computes them."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, a_first: bool) -> torch.Tensor:
        if a_first:
            ya = self.a(x)
            return ya + self.b(x)
        yb = self.b(x)
        return self.a(x) + yb


def _ready_order_changes(rank: int, world_size: int, static: bool) -> dict:
    torch.manual_seed(0)
    model = _Swapped()
    reference = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model), static_graph=static)
    ddp = gradsync.DistributedDataParallel(model, static_graph=static)  # one bucket: the order inside it matters
    diffs, quiet = [], []
    for step, a_first in enumerate([True, True, True, False, False, True]):
        for net in (ddp, reference):
            torch.manual_seed(10 * step + rank)
            net.zero_grad()
            net(torch.randn(3, 4), a_first).pow(2).sum().backward()
        diffs.append(_largest_difference(model, reference))
        quiet.append(ddp.reducer.quiet_parameters())
    return {"diffs": diffs, "quiet": quiet}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("static", [False, True])
def test_a_changed_ready_order_waits_for_the_late_gradients_then_keeps_every_hook(static: bool) -> None:
    # The quiet parameters fired after their bucket's last-ready one (the forward swapped the layers): the bucket
    # waits for them, and from the next forward every parameter reports through its own hook.
    for result in spawn(_ready_order_changes, args=(static,), timeout=50):
        assert result["diffs"] == [0.0] * 6, result
        assert result["quiet"][2] == 3 and result["quiet"][4:] == [0, 0], result


def test_a_backward_is_nested_only_below_another_one_on_the_same_thread() -> None:
    """The reducer reports a missing gradient when the outermost backward ends, and waits when a reentrant one ends
    (gradients of the outer may still come). On a GPU the engine ends the outermost backward on its device thread,
    which holds no backward frame of its own: that must count as outermost, or every CUDA backward looks nested and
    the error comes a step late. A plain thread stands in for the device thread here."""
    import threading

    from gradsync.reducer import backward

    caller = threading.get_ident()
    seen: dict[str, bool] = {}

    def note(key: str) -> None:
        seen[key] = backward.inside_nested_backward(caller)

    class Reentrant(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):  # type: ignore[no-untyped-def]
            return x.clone()

        @staticmethod
        def backward(ctx, grad):  # type: ignore[no-untyped-def]
            inner = torch.ones(1, requires_grad=True)
            inner.register_post_accumulate_grad_hook(lambda _p: note("caller, reentrant"))
            with torch.enable_grad():  # as torch.utils.checkpoint's reentrant backward does
                (inner * 2).sum().backward()
            return grad

    outer = torch.ones(1, requires_grad=True)
    outer.register_post_accumulate_grad_hook(lambda _p: note("caller, outermost"))
    Reentrant.apply(outer).sum().backward()

    def device_thread() -> None:
        note("device thread, outermost")  # the engine's own thread ending the outermost backward: no frame
        inner = torch.ones(1, requires_grad=True)
        inner.register_post_accumulate_grad_hook(lambda _p: note("device thread, reentrant"))
        (inner * 2).sum().backward()  # a backward called on that thread: a reentrant one

    thread = threading.Thread(target=device_thread)
    thread.start()
    thread.join()
    assert seen == {
        "caller, outermost": False,
        "caller, reentrant": True,
        "device thread, outermost": False,
        "device thread, reentrant": True,
    }
