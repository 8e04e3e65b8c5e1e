"""Models that differ between ranks (2 gloo ranks): every difference refused at construction on every rank, and
differences in values only accepted (rank 0's values win)."""

from __future__ import annotations

import torch
from torch import nn

import gradsync
from conformance.sweep.core import case, ranks
from conformance.sweep.util import same_and_right, seeded, train_compare
from lab.zoo.toys import Shallow, ShallowBN, ShallowWithBuffer

CAT = "model mismatch"
BOTH = (0, 1)


def _wrap_and_train(rank: int, world: int, make_0, make_1) -> dict:
    torch.manual_seed(0)
    model = make_0() if rank == 0 else make_1()
    ddp = gradsync.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for _step in range(2):
        opt.zero_grad()
        ddp(torch.randn(4, 6)).pow(2).mean().backward()
        opt.step()
    return {"buffers": [b.tolist() for b in ddp.module.buffers()]}


def _buf_f64() -> nn.Module:
    return ShallowWithBuffer((3,), torch.float64)


def _buf_5() -> nn.Module:
    return ShallowWithBuffer((5,))


def _buf_extra() -> nn.Module:
    return ShallowWithBuffer(extra=True)


def _no_buf() -> nn.Module:
    return ShallowWithBuffer(None)


def _wide() -> nn.Module:
    return Shallow(hidden=9)


def _deeper() -> nn.Module:
    m = Shallow()
    m.fc3 = nn.Linear(3, 3)  # registered, unused in forward: a rank-dependent extra layer
    return m


def _double() -> nn.Module:
    return Shallow().double()


def _frozen_first() -> nn.Module:
    m = Shallow()
    m.fc1.requires_grad_(False)
    return m


class _Renamed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(6, 8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.first(x)))


def _mismatch_case(name: str, how: str, make_1, keywords, make_0=ShallowWithBuffer) -> None:
    @case(name, CAT, how, keywords)
    def _():
        return ranks(_wrap_and_train, make_0, make_1, must_fail=BOTH)


_mismatch_case(
    "buffer_dtype_float64_on_rank1", "a float64 buffer on rank 1, float32 on rank 0", _buf_f64, ["stat", "dtype"]
)
_mismatch_case("buffer_extra_on_rank1", "an extra buffer on rank 1", _buf_extra, ["extra", "rank 1"])
_mismatch_case(
    "buffer_extra_on_rank0",
    "an extra buffer on rank 0 (used to SIGABRT rank 1)",
    ShallowWithBuffer,
    ["extra", "rank 1"],
    make_0=_buf_extra,
)
_mismatch_case("buffer_shape_5_vs_3", "a (5,) buffer on rank 1, (3,) on rank 0", _buf_5, ["stat", "shape"])
_mismatch_case("buffer_missing_on_rank1", "rank 1 has no buffer at all", _no_buf, ["stat", "rank 1"])
_mismatch_case(
    "param_shape_differs", "hidden width 9 on rank 1, 8 on rank 0", _wide, ["fc1.weight", "shape"], make_0=Shallow
)
_mismatch_case(
    "param_extra_layer_rank1", "an extra Linear registered on rank 1", _deeper, ["fc3", "rank 1"], make_0=Shallow
)
_mismatch_case(
    "param_dtype_rank1_double", "model.double() on rank 1 only", _double, ["dtype", "float64"], make_0=Shallow
)
_mismatch_case(
    "param_frozen_on_rank1", "fc1 frozen on rank 1 only", _frozen_first, ["fc1", "requires_grad"], make_0=Shallow
)
_mismatch_case(
    "param_name_differs", "same shapes, another attribute name on rank 1", _Renamed, ["first.weight"], make_0=Shallow
)


def _values_differ(rank: int, world: int, kind: str) -> dict:
    model, _ = seeded(ShallowBN if kind == "bn" else Shallow, seed=rank)  # different weights (and statistics) per rank
    if kind == "bn":
        model.bn.running_mean.fill_(float(rank))
    ddp = gradsync.DistributedDataParallel(model)
    ref = ShallowBN() if kind == "bn" else Shallow()
    ref.load_state_dict(ddp.module.state_dict())  # after construction: rank 0's values everywhere
    return train_compare(ddp, ref, rank, world, steps=2)


@case("params_differ_in_value", CAT, "different initial weights per rank: rank 0's are broadcast", check=same_and_right)
def _():
    return ranks(_values_differ, "mlp")


@case("buffers_differ_in_value", CAT, "BatchNorm statistics differ per rank at construction", check=same_and_right)
def _():
    return ranks(_values_differ, "bn")
