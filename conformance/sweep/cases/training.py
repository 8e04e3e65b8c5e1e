"""The training loop (2 gloo ranks): ranks that drift out of step, peers that die, hang or stop, parameters that
get no gradient, uneven inputs, and unusual-but-valid loops."""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed as dist
from torch import nn

import gradsync
from conformance.sweep.core import case, ranks
from conformance.sweep.util import batch, loss_of, replicas_equal, same_and_right, seeded, setenv, train_compare
from lab.zoo.toys import Shallow, ShallowBN

CAT = "training loop"


def _skip_backward(rank: int, world: int, debug: str, model: str) -> dict:
    setenv(GRADSYNC_DEBUG=debug)
    net, _ = seeded(ShallowBN if model == "bn" else Shallow)
    ddp = gradsync.DistributedDataParallel(net)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(4):
        opt.zero_grad()
        loss = loss_of(ddp(batch(step, rank)))
        if rank == 1 and step == 1:
            continue  # a rank-dependent skip
        loss.backward()
        opt.step()
    return {"params": [p.detach().flatten().tolist() for p in net.parameters()]}


def _flat_params(results: list) -> str | None:
    return replicas_equal([{"params": sum(r["params"], [])} for r in results])


@case(
    "desync_skip_backward_debug",
    CAT,
    "GRADSYNC_DEBUG=1, rank 1 skips one backward (BatchNorm model)",
    ["out of step", "rank 0:", "rank 1:"],
)
def _():
    return ranks(_skip_backward, "1", "bn", must_fail=(0, 1))


@case(
    "desync_skip_backward_debug_mlp",
    CAT,
    "GRADSYNC_DEBUG=1, rank 1 skips one backward (no buffers)",
    ["out of step", "rank 0:", "rank 1:"],
)
def _():
    return ranks(_skip_backward, "1", "mlp", must_fail=(0, 1))


@case(
    "desync_skip_backward_nodebug",
    CAT,
    "rank 1 skips one backward, no GRADSYNC_DEBUG (BatchNorm model): must not hang or go on",
    [("out of step", "GRADSYNC_DEBUG")],
    check=_flat_params,
)
def _():
    return ranks(_skip_backward, "0", "bn")


def _skip_step(rank: int, world: int, debug: str) -> dict:
    setenv(GRADSYNC_DEBUG=debug)
    net, _ = seeded(Shallow)
    ddp = gradsync.DistributedDataParallel(net)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(4):
        if rank == 1 and step == 1:
            continue  # the whole step: no forward, no backward
        opt.zero_grad()
        loss_of(ddp(batch(step, rank))).backward()
        opt.step()
    return {"params": [p.detach().flatten().tolist() for p in net.parameters()]}


@case(
    "desync_skip_step_debug",
    CAT,
    "GRADSYNC_DEBUG=1, rank 1 skips a whole step (forward and backward), then finishes a step early",
    [("rank(s) [1]", "rank 1"), ("out of step", "never reached")],
)
def _():
    return ranks(_skip_step, "1", must_fail=(0,))


@case(
    "desync_skip_step_nodebug",
    CAT,
    "rank 1 skips a whole step, no GRADSYNC_DEBUG: one rank runs a step more than the other",
    [("rank(s) [1]", "rank 1", "join")],
    check=_flat_params,
)
def _():
    return ranks(_skip_step, "0")


def _rank_no_sync(rank: int, world: int, debug: str, model: str) -> dict:
    setenv(GRADSYNC_DEBUG=debug)
    net, _ = seeded(ShallowBN if model == "bn" else Shallow)
    ddp = gradsync.DistributedDataParallel(net)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(3):
        opt.zero_grad()
        if rank == 0 and step == 1:  # data-dependent accumulation on one rank only
            with ddp.no_sync():
                loss_of(ddp(batch(step, rank))).backward()
        loss_of(ddp(batch(step, rank + 10))).backward()
        opt.step()
    return {"params": [p.detach().flatten().tolist() for p in net.parameters()]}


@case(
    "rank_dependent_no_sync_debug",
    CAT,
    "GRADSYNC_DEBUG=1, rank 0 runs an extra no_sync micro-batch that rank 1 does not (no buffers: harmless)",
    ["out of step"],
    check=_flat_params,
)
def _():
    return ranks(_rank_no_sync, "1", "mlp")


@case(
    "rank_dependent_no_sync_debug_bn",
    CAT,
    "GRADSYNC_DEBUG=1, rank 0 runs an extra no_sync micro-batch (BatchNorm: the buffer broadcasts differ)",
    ["out of step", "rank 0:", "rank 1:"],
    check=_flat_params,
)
def _():
    return ranks(_rank_no_sync, "1", "bn")


@case(
    "rank_dependent_no_sync_bn",
    CAT,
    "rank 0 runs an extra no_sync micro-batch (BatchNorm), no GRADSYNC_DEBUG",
    [("out of step", "GRADSYNC_DEBUG")],
    check=_flat_params,
)
def _():
    return ranks(_rank_no_sync, "0", "bn")


def _unused(rank: int, world: int, which: str) -> None:
    torch.manual_seed(0)
    net = Shallow()
    net.spare = nn.Linear(3, 3)
    ddp = gradsync.DistributedDataParallel(net)
    out = ddp(batch(0, rank))
    if which == "rank1" and rank == 0:
        out = ddp.module.spare(out)  # rank 0 uses 'spare', rank 1 does not
    loss_of(out).backward()


@case(
    "unused_parameter_everywhere",
    CAT,
    "a registered layer no rank uses, find_unused_parameters=False",
    ["spare.weight", "find_unused_parameters=True"],
)
def _():
    return ranks(_unused, "all", must_fail=(0, 1))


@case(
    "unused_parameter_on_rank1",
    CAT,
    "a layer only rank 0 uses, find_unused_parameters=False",
    ["find_unused_parameters=True"],
)
def _():
    return ranks(_unused, "rank1", must_fail=(0, 1))


def _peer_dies(rank: int, world: int, how: str) -> None:
    ddp = gradsync.DistributedDataParallel(seeded(Shallow)[0])
    for step in range(3):
        loss = loss_of(ddp(batch(step, rank)))
        if rank == 1 and step == 1:
            if how == "exit":
                os._exit(1)
            os.kill(os.getpid(), signal.SIGKILL)
        loss.backward()


@case(
    "peer_exits_mid_training",
    CAT,
    "rank 1 calls os._exit(1) before a backward",
    ["all-reduce of bucket", "rank(s) [1]"],
)
def _():
    return ranks(_peer_dies, "exit", dies=(1,), must_fail=(0,))


@case("peer_sigkilled", CAT, "rank 1 is SIGKILLed before a backward", ["all-reduce of bucket", "rank(s) [1]"])
def _():
    return ranks(_peer_dies, "kill", dies=(1,), must_fail=(0,))


def _peer_sleeps(rank: int, world: int, seconds: float) -> float:
    ddp = gradsync.DistributedDataParallel(seeded(Shallow)[0])
    loss = loss_of(ddp(batch(0, rank)))
    if rank == 1:
        time.sleep(seconds)  # stuck in the data loader, say, while rank 0 waits in the all-reduce
        return 0.0
    start = time.monotonic()
    loss.backward()
    return time.monotonic() - start


@case(
    "peer_hangs",
    CAT,
    "rank 1 sleeps 9 s before its backward (process-group timeout 4 s)",
    # The first backward's first collective compares the comm hooks; later ones are the buckets' all-reduces.
    [("all-reduce of bucket", "comparison of the communication hooks"), "never reached"],
    rank_keywords={1: ()},
    timeout=40,
)
def _():
    return ranks(_peer_sleeps, 9.0, pg_timeout=4.0, must_fail=(0,))


def _peer_stopped(rank: int, world: int) -> None:
    ddp = gradsync.DistributedDataParallel(seeded(Shallow)[0])
    pids = [None, None]
    dist.all_gather_object(pids, os.getpid())
    loss = loss_of(ddp(batch(0, rank)))
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # stopped (Ctrl-Z, a debugger, a swapped-out VM) before its backward
        loss.backward()
        return
    try:
        loss.backward()
    finally:
        os.kill(pids[1], signal.SIGCONT)


@case(
    "peer_sigstopped",
    CAT,
    "rank 1 SIGSTOPs itself before its backward; rank 0 must time out (4 s), then wakes it",
    [("all-reduce of bucket", "comparison of the communication hooks"), ("never reached", "rank 1")],
    rank_keywords={1: [("all-reduce of bucket", "comparison of the communication hooks")]},
    timeout=40,
)
def _():
    return ranks(_peer_stopped, pg_timeout=4.0, must_fail=(0,))


def _uneven(rank: int, world: int, use_join: bool) -> dict:
    net, ref = seeded(Shallow)
    ddp = gradsync.DistributedDataParallel(net)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    steps = 3 if rank == 0 else 2
    context = ddp.join() if use_join else _Nothing()
    with context:
        for step in range(steps):
            opt.zero_grad()
            loss_of(ddp(batch(step, rank))).backward()
            opt.step()
    return {"params": [p.detach().flatten().tolist() for p in net.parameters()]}


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@case("uneven_inputs_with_join", CAT, "rank 0 has 3 batches, rank 1 has 2, inside ddp.join()", check=_flat_params)
def _():
    return ranks(_uneven, True)


@case(
    "uneven_inputs_without_join",
    CAT,
    "rank 0 has 3 batches, rank 1 has 2, no join(): rank 0 waits for a rank that left",
    ["rank(s) [1]", "join"],
)
def _():
    return ranks(_uneven, False, must_fail=(0,))


def _ordinary(rank: int, world: int, variant: str) -> dict:
    net, ref = seeded(Shallow)
    ddp = gradsync.DistributedDataParallel(net)
    if variant == "forward_without_backward":
        ddp(batch(99, rank))  # an evaluation forward without torch.no_grad()
    if variant == "different_batch_sizes":
        make = lambda step, r: batch(step, r, n=2 + 6 * r)  # noqa: E731
        return train_compare(ddp, ref, rank, world, make=make)
    if variant == "nan_on_rank1":
        make = lambda step, r: batch(step, r) * (float("nan") if r == 1 and step == 1 else 1.0)  # noqa: E731
        return train_compare(ddp, ref, rank, world, make=make)  # NaN everywhere, as with torch
    return train_compare(ddp, ref, rank, world)


@case(
    "forward_without_backward",
    CAT,
    "an evaluation forward without no_grad() (no backward), then normal training",
    check=same_and_right,
)
def _():
    return ranks(_ordinary, "forward_without_backward")


@case(
    "different_batch_sizes",
    CAT,
    "rank 0 batches of 2, rank 1 of 8 (DDP averages per-rank means)",
    check=same_and_right,
)
def _():
    return ranks(_ordinary, "different_batch_sizes")


@case(
    "nan_loss_on_rank1",
    CAT,
    "rank 1's batch is NaN at step 1: every replica must get the same NaN parameters, as with torch",
    check=same_and_right,
)
def _():
    return ranks(_ordinary, "nan_on_rank1")


def _changed_after_wrap(rank: int, world: int, how: str) -> dict:
    net, ref = seeded(Shallow)
    net.fc1.requires_grad_(False)
    ref.fc1.requires_grad_(False)
    ddp = gradsync.DistributedDataParallel(net)
    if how == "unfreeze":
        net.fc1.requires_grad_(True)  # unfrozen after wrapping (fine-tuning schedules do this)
        ref.fc1.requires_grad_(True)
    else:
        net.fc2.weight = nn.Parameter(net.fc2.weight.detach().clone())  # replaced after wrapping
    return train_compare(ddp, ref, rank, world)


@case(
    "param_unfrozen_after_wrap",
    CAT,
    "fc1 frozen at construction, requires_grad_(True) after wrapping: its gradients must still be averaged",
    ["fc1", "requires_grad"],
    check=same_and_right,
)
def _():
    return ranks(_changed_after_wrap, "unfreeze")


@case(
    "param_replaced_after_wrap",
    CAT,
    "module.fc2.weight replaced by a new Parameter after wrapping",
    ["fc2.weight"],
    check=same_and_right,
)
def _():
    return ranks(_changed_after_wrap, "replace")


def _debug_control(rank: int, world: int) -> dict:
    setenv(GRADSYNC_DEBUG="1")
    net, ref = seeded(ShallowBN)
    ddp = gradsync.DistributedDataParallel(net)
    return train_compare(ddp, ref, rank, world)


@case(
    "debug_on_correct_loop",
    CAT,
    "GRADSYNC_DEBUG=1 on a correct loop (BatchNorm): no false alarm, right numbers",
    check=lambda results: replicas_equal(results),
)
def _():
    return ranks(_debug_control)


def _nested(rank: int, world: int) -> dict:
    net, ref = seeded(Shallow)
    inner = gradsync.DistributedDataParallel(net)
    outer = gradsync.DistributedDataParallel(inner)
    return train_compare(outer, ref, rank, world)


@case(
    "ddp_wrapped_twice",
    CAT,
    "DDP(DDP(model)): two wrappers of one module",
    ["DistributedDataParallel"],
    check=same_and_right,
)
def _():
    return ranks(_nested)
