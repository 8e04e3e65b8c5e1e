"""ShardedOptimizer (ZeRO-1) and OverlappedOptimizer: parameter lists that differ between ranks, a collective
called on one rank only, wrong classes and misuse of the state-dict protocol."""

from __future__ import annotations

import time

import torch
from torch import nn

import gradsync
from conformance.sweep.core import case, group1, ranks
from conformance.sweep.util import batch, flat, loss_of, replicas_equal, seeded
from lab.zoo.toys import Shallow

CAT = "optimizer"


class TwoSquare(nn.Module):
    """Two layers of identical shapes: a swapped order cannot be seen from shapes alone."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _sharded_order(rank: int, world: int, model: str) -> dict:
    net, _ = seeded(TwoSquare if model == "square" else Shallow)
    ddp = gradsync.DistributedDataParallel(net)
    params = list(ddp.parameters())
    if rank == 1:
        if model == "square":
            params = [params[2], params[1], params[0], params[3]]  # a.weight and b.weight swapped
        else:
            params = params[::-1]
    opt = gradsync.ShardedOptimizer(params, torch.optim.SGD, lr=0.1)
    width = 4 if model == "square" else 6
    for step in range(2):
        opt.zero_grad()
        loss_of(ddp(batch(step, rank, d=width))).backward()
        opt.step()
    return {"params": flat(net)}


@case(
    "sharded_param_order_differs",
    CAT,
    "ShardedOptimizer(params) with rank 1's list reversed",
    ["order"],
    check=replicas_equal,
)
def _():
    return ranks(_sharded_order, "mlp", must_fail=(0, 1))


@case(
    "sharded_param_order_same_shapes",
    CAT,
    "ShardedOptimizer with two same-shape weights swapped on rank 1 (shapes cannot tell)",
    ["order"],
    check=replicas_equal,
)
def _():
    return ranks(_sharded_order, "square", must_fail=(0, 1))


def _sharded_subset(rank: int, world: int) -> dict:
    net, _ = seeded(Shallow)
    ddp = gradsync.DistributedDataParallel(net)
    params = list(ddp.parameters())
    opt = gradsync.ShardedOptimizer(params if rank == 0 else params[:2], torch.optim.SGD, lr=0.1)
    loss_of(ddp(batch(0, rank))).backward()
    opt.step()
    return {"params": flat(net)}


@case("sharded_param_count_differs", CAT, "ShardedOptimizer over 4 parameters on rank 0, 2 on rank 1", ["rank 1"])
def _():
    return ranks(_sharded_subset, must_fail=(0, 1))


def _sharded_single(fn):
    group1()
    net, _ = seeded(Shallow)
    return fn(net)


@case("sharded_optimizer_class_string", CAT, "ShardedOptimizer(params, optimizer_class='adam')", ["optimizer_class"])
def _():
    return _sharded_single(lambda net: repr(gradsync.ShardedOptimizer(net.parameters(), "adam", lr=0.1))[:40])


@case(
    "sharded_optimizer_instance",
    CAT,
    "ShardedOptimizer(params, optimizer_class=torch.optim.SGD(...)): an instance, not the class",
    ["optimizer_class"],
)
def _():
    def run(net):
        inner = torch.optim.SGD(net.parameters(), lr=0.1)
        return repr(gradsync.ShardedOptimizer(net.parameters(), inner, lr=0.1))[:40]

    return _sharded_single(run)


@case("sharded_empty_params", CAT, "ShardedOptimizer([])", ["empty"])
def _():
    return _sharded_single(lambda net: repr(gradsync.ShardedOptimizer([], torch.optim.SGD, lr=0.1))[:40])


@case(
    "sharded_state_dict_unconsolidated",
    CAT,
    "ShardedOptimizer.state_dict() without consolidating",
    ["consolidate_state_dict"],
)
def _():
    return _sharded_single(
        lambda net: gradsync.ShardedOptimizer(net.parameters(), torch.optim.SGD, lr=0.1).state_dict()
    )


@case(
    "sharded_load_wrong_groups",
    CAT,
    "ShardedOptimizer.load_state_dict of an Adam state over 2 parameters (it has 4)",
    ["parameter groups"],
)
def _():
    def run(net):
        opt = gradsync.ShardedOptimizer(net.parameters(), torch.optim.Adam, lr=0.1)
        other = torch.optim.Adam(list(net.parameters())[:2], lr=0.1)
        opt.load_state_dict(other.state_dict())
        return "loaded"

    return _sharded_single(run)


def _consolidate_rank0(rank: int, world: int) -> str:
    net, _ = seeded(Shallow)
    ddp = gradsync.DistributedDataParallel(net)
    opt = gradsync.ShardedOptimizer(ddp.parameters(), torch.optim.Adam, lr=0.01)
    loss_of(ddp(batch(0, rank))).backward()
    opt.step()
    if rank == 0:
        opt.consolidate_state_dict(to=0)  # a collective, called on rank 0 only
        return "consolidated"
    time.sleep(8)  # rank 1 goes on with other work
    return "slept"


@case(
    "sharded_consolidate_on_rank0_only",
    CAT,
    "`if rank == 0: opt.consolidate_state_dict()` (process-group timeout 4 s)",
    [("consolidate_state_dict", "state shards"), ("rank(s) [1]", "every rank")],
    timeout=40,
)
def _():
    return ranks(_consolidate_rank0, pg_timeout=4.0, must_fail=(0,))


def _more_ranks_than_params(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    net = nn.Linear(6, 1, bias=False)  # one parameter, two ranks: rank 1 owns nothing
    ddp = gradsync.DistributedDataParallel(net)
    opt = gradsync.ShardedOptimizer(ddp.parameters(), torch.optim.Adam, lr=0.01)
    for step in range(3):
        opt.zero_grad()
        loss_of(ddp(batch(step, rank))).backward()
        opt.step()
    return {"params": flat(net)}


@case("sharded_rank_owns_nothing", CAT, "ShardedOptimizer with 1 parameter on 2 ranks", check=replicas_equal)
def _():
    return ranks(_more_ranks_than_params)


def _uneven_sharded(rank: int, world: int) -> dict:
    net, _ = seeded(Shallow)
    ddp = gradsync.DistributedDataParallel(net)
    opt = gradsync.ShardedOptimizer(ddp.parameters(), torch.optim.SGD, lr=0.1)
    with ddp.join():  # not Join([ddp, opt]): the joined rank does not shadow the optimizer's all-gather
        for step in range(3 if rank == 0 else 2):
            opt.zero_grad()
            loss_of(ddp(batch(step, rank))).backward()
            opt.step()
    return {"params": flat(net)}


@case(
    "sharded_uneven_join_ddp_only",
    CAT,
    "uneven inputs with ddp.join() but a ShardedOptimizer (README: use Join([ddp, optimizer]))",
    ["Join"],
    check=replicas_equal,
)
def _():
    return ranks(_uneven_sharded)


@case("overlapped_on_plain_module", CAT, "OverlappedOptimizer(nn.Linear(...), SGD)", ["DistributedDataParallel"])
def _():
    from gradsync.optim import OverlappedOptimizer

    return repr(OverlappedOptimizer(nn.Linear(2, 2), torch.optim.SGD, lr=0.1))[:40]


@case(
    "overlapped_find_unused",
    CAT,
    "OverlappedOptimizer on a DDP with find_unused_parameters=True",
    ["OverlappedOptimizer", "find_unused"],
)
def _():
    from gradsync.optim import OverlappedOptimizer

    def run(net):
        ddp = gradsync.DistributedDataParallel(net, find_unused_parameters=True)
        return repr(OverlappedOptimizer(ddp, torch.optim.SGD, lr=0.1))[:40]

    return _sharded_single(run)
