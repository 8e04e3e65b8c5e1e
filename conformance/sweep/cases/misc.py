"""Unusual but valid models (dtypes, empty and non-contiguous parameters, mixed dtypes), SyncBatchNorm edge batches,
and the Monitor's output paths."""

from __future__ import annotations

import torch
from torch import nn

import gradsync
from conformance.sweep.core import case, group1, ranks
from conformance.sweep.util import batch, flat, loss_of, same_and_right, seeded, train_compare
from lab.zoo.toys import Shallow, ShallowBN

CAT = "collectives/models"


def _dtype_model(rank: int, world: int, dtype_name: str) -> dict:
    dtype = getattr(torch, dtype_name)
    net, ref = seeded(lambda: Shallow().to(dtype))
    ddp = gradsync.DistributedDataParallel(net)
    make = lambda step, r: batch(step, r, dtype=dtype)  # noqa: E731
    return train_compare(ddp, ref, rank, world, steps=2, make=make)


for _dtype, _tol in (("float64", 1e-9), ("float16", 2e-2), ("bfloat16", 5e-2)):

    @case(
        f"model_{_dtype}",
        CAT,
        f"a {_dtype} model on CPU/gloo",
        [_dtype],
        check=lambda results, tol=_tol: same_and_right(results, tol=tol),
    )
    def _(dtype=_dtype):
        return ranks(_dtype_model, dtype)


class Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.f32 = nn.Linear(6, 8)
        self.f64 = nn.Linear(8, 3).double()

    def forward(self, x):
        return self.f64(torch.tanh(self.f32(x)).double())


class Odd(nn.Module):
    """An empty parameter, a non-contiguous (transposed) one, and a scalar one."""

    def __init__(self) -> None:
        super().__init__()
        self.empty = nn.Parameter(torch.zeros(0))
        self.t = nn.Parameter(torch.randn(3, 6).t())  # (6, 3), not contiguous
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        return (x @ self.t) * self.scale + self.empty.sum()


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 6, bias=False)
        self.out = nn.Linear(6, 6, bias=False)
        self.out.weight = self.inp.weight

    def forward(self, x):
        return self.out(torch.tanh(self.inp(x)))


class BoolBuffer(Shallow):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mask", torch.tensor([True, False, True]))
        self.register_buffer("count", torch.zeros((), dtype=torch.int64))

    def forward(self, x):
        self.count += 1
        return super().forward(x) * self.mask


MODELS = {"mixed": Mixed, "odd": Odd, "tied": Tied, "boolbuf": BoolBuffer}


def _odd_model(rank: int, world: int, name: str, kwargs: dict) -> dict:
    net, ref = seeded(MODELS[name])
    ddp = gradsync.DistributedDataParallel(net, **kwargs)
    return train_compare(ddp, ref, rank, world)


def _model_case(name: str, model: str, how: str, kwargs: dict | None = None) -> None:
    @case(name, CAT, how, check=same_and_right)
    def _():
        return ranks(_odd_model, model, kwargs or {})


_model_case("model_mixed_dtypes", "mixed", "a float32 layer feeding a float64 layer")
_model_case("model_empty_noncontiguous_scalar", "odd", "an empty, a transposed (non-contiguous) and a 0-d parameter")
_model_case(
    "model_odd_params_bucket_view",
    "odd",
    "the same odd parameters with gradient_as_bucket_view=True",
    {"gradient_as_bucket_view": True},
)
_model_case("model_tied_weights", "tied", "one weight shared by two layers")
_model_case("model_bool_and_int_buffers", "boolbuf", "a bool mask buffer and an int64 counter buffer")


def _outputs(rank: int, world: int, kind: str) -> dict:
    net, ref = seeded(Shallow)

    class Wrap(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            y = self.inner(x)
            return {"out": [y], "aux": (y.detach(), "text", 3)} if kind == "nested" else y

    ddp = gradsync.DistributedDataParallel(Wrap(net))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(2):
        opt.zero_grad()
        loss_of(ddp(batch(step, rank))["out"][0]).backward()
        opt.step()
        ref_opt.zero_grad()
        (sum(loss_of(ref(batch(step, r))) for r in range(world)) / world).backward()
        ref_opt.step()
    mine = flat(net)
    return {"params": mine, "ref_diff": max(abs(a - b) for a, b in zip(mine, flat(ref))), "buffers": []}


@case(
    "forward_returns_nested",
    CAT,
    "forward returns a dict of lists and tuples with a string and an int inside",
    check=same_and_right,
)
def _():
    return ranks(_outputs, "nested")


def _syncbn(rank: int, world: int, sizes: tuple[int, int]) -> dict:
    torch.manual_seed(0)
    bn = gradsync.SyncBatchNorm(4)
    n = sizes[rank]
    x = torch.randn(max(sizes), 4, generator=torch.Generator().manual_seed(rank))[:n]
    out = bn(x)
    return {"finite": bool(torch.isfinite(out).all()), "running_mean": bn.running_mean.tolist()}


def _syncbn_right(results) -> str | None:
    if not all(r["finite"] for r in results):
        return f"non-finite output: {results}"
    if results[0]["running_mean"] != results[1]["running_mean"]:
        return f"running statistics differ between ranks: {results}"
    return None


@case("syncbn_batch_sizes_differ", CAT, "SyncBatchNorm, batch 2 on rank 0 and 6 on rank 1", check=_syncbn_right)
def _():
    return ranks(_syncbn, (2, 6))


@case(
    "syncbn_empty_batch_on_rank1",
    CAT,
    "SyncBatchNorm, batch 4 on rank 0 and 0 on rank 1",
    ["empty"],
    check=_syncbn_right,
)
def _():
    return ranks(_syncbn, (4, 0))


@case("syncbn_1d_input", CAT, "SyncBatchNorm(4) applied to a 1-D tensor", ["2 dimensions"])
def _():
    group1()
    return gradsync.SyncBatchNorm(4)(torch.randn(4)).tolist()


@case("syncbn_convert_not_module", CAT, "SyncBatchNorm.convert_sync_batchnorm('model')", ["Module"])
def _():
    group1()
    return repr(gradsync.SyncBatchNorm.convert_sync_batchnorm("model"))


def _monitor_export(path: str) -> str:
    from gradsync.observe import Monitor

    group1()
    net, _ = seeded(ShallowBN)
    ddp = gradsync.DistributedDataParallel(net)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    monitor = Monitor(ddp, opt)
    for step in range(2):
        opt.zero_grad()
        loss_of(ddp(batch(step, 0))).backward()
        opt.step()
    monitor.export_chrome_trace(path)
    return "exported"


@case(
    "monitor_export_unwritable", CAT, "Monitor.export_chrome_trace('/proc/nope/trace.json')", ["/proc/nope/trace.json"]
)
def _():
    return _monitor_export("/proc/nope/trace.json")


@case("monitor_not_ddp", CAT, "Monitor(nn.Linear(2, 2))", ["DistributedDataParallel"])
def _():
    from gradsync.observe import Monitor

    group1()
    return repr(Monitor(nn.Linear(2, 2)))
