"""Communication hooks and the local-SGD / compression helpers: misuse of register_comm_hook, hooks that return
the wrong thing, never complete or raise, and bad settings of the built-in ones."""

from __future__ import annotations

import torch
import torch.distributed as dist

import gradsync
from conformance.sweep.core import case, group1, ranks
from conformance.sweep.util import batch, loss_of, same_and_right, seeded, train_compare
from lab.zoo.toys import Shallow

CAT = "comm hooks"


def _done(value) -> torch.futures.Future:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(value)
    return fut


def _hook_wrong_shape(state, bucket):
    return _done(torch.zeros(3))


def _hook_returns_tensor(state, bucket):
    return bucket.buffer()


def _hook_returns_none(state, bucket):
    return None


def _hook_raises(state, bucket):
    raise ValueError("my hook failed: codec not configured")


def _hook_raises_on_rank_1(state, bucket):
    # The same hook everywhere (the first backward compares them), failing on one rank only.
    if dist.get_rank() == 1:
        _hook_raises(state, bucket)
    from gradsync.comm import allreduce_hook

    return allreduce_hook(state, bucket)


def _hook_never_completes(state, bucket):
    return torch.futures.Future()


def _hook_float64(state, bucket):
    group = dist.group.WORLD
    tensor = bucket.buffer().double() / dist.get_world_size(group)
    dist.all_reduce(tensor, group=group)
    return _done(tensor)


def _hook_list(state, bucket):
    tensor = bucket.buffer() / dist.get_world_size()
    dist.all_reduce(tensor)
    return _done([tensor])


HOOKS = {
    "wrong_shape": _hook_wrong_shape,
    "tensor": _hook_returns_tensor,
    "none": _hook_returns_none,
    "raises": _hook_raises,
    "raises_rank1": _hook_raises_on_rank_1,
    "never": _hook_never_completes,
    "float64": _hook_float64,
    "list": _hook_list,
}


def _with_hook(rank: int, world: int, name: str) -> dict:
    net, ref = seeded(Shallow)
    ddp = gradsync.DistributedDataParallel(net)
    ddp.register_comm_hook(None, HOOKS[name])
    return train_compare(ddp, ref, rank, world, steps=2)


def _single(fn):
    group1()
    torch.manual_seed(0)
    ddp = gradsync.DistributedDataParallel(Shallow())
    return fn(ddp)


def _train_once(ddp) -> None:
    loss_of(ddp(batch(0, 0))).backward()


@case("hook_returns_wrong_shape", CAT, "a hook whose future holds torch.zeros(3)", ["hook", "elements"])
def _():
    return ranks(_with_hook, "wrong_shape", must_fail=(0, 1))


@case("hook_returns_tensor", CAT, "a hook returning the tensor itself, not a Future", ["hook", "Future"])
def _():
    return ranks(_with_hook, "tensor", must_fail=(0, 1))


@case("hook_returns_none", CAT, "a hook returning None", ["hook", "Future"])
def _():
    return ranks(_with_hook, "none", must_fail=(0, 1))


@case(
    "hook_raises_on_rank1",
    CAT,
    "rank 1's hook raises ValueError('my hook failed ...'); rank 0's all-reduces",
    ["my hook failed"],
    rank_keywords={0: [("rank 1", "rank(s) [1]")]},
)
def _():
    return ranks(_with_hook, "raises_rank1", must_fail=(0, 1))


@case(
    "hook_future_never_completes",
    CAT,
    "a hook returning a Future nobody completes (process-group timeout 5 s)",
    ["hook", "complete"],
    timeout=40,
)
def _():
    return ranks(_with_hook, "never", pg_timeout=5.0, must_fail=(0, 1))


@case(
    "hook_returns_float64",
    CAT,
    "a hook averaging in float64 and returning the float64 tensor (right values, another dtype)",
    ["dtype"],
    check=same_and_right,
)
def _():
    return ranks(_with_hook, "float64")


@case(
    "hook_returns_list",
    CAT,
    "a hook whose future holds [tensor] (as dist.all_reduce's future does)",
    ["hook"],
    check=same_and_right,
)
def _():
    return ranks(_with_hook, "list")


@case("hook_not_callable", CAT, "register_comm_hook(None, 'allreduce')", ["hook", "callable"])
def _():
    return _single(lambda ddp: ddp.register_comm_hook(None, "allreduce"))


def _register_twice(ddp):
    from gradsync.comm import allreduce_hook

    ddp.register_comm_hook(None, allreduce_hook)
    ddp.register_comm_hook(None, allreduce_hook)


@case("hook_registered_twice", CAT, "register_comm_hook called twice", ["already registered"])
def _():
    return _single(_register_twice)


def _register_late(ddp):
    from gradsync.comm import allreduce_hook

    _train_once(ddp)
    ddp.register_comm_hook(None, allreduce_hook)


@case("hook_after_first_backward", CAT, "register_comm_hook after a backward", ["before the first backward"])
def _():
    return _single(_register_late)


@case("hook_wrong_arity", CAT, "a hook taking one argument: lambda bucket: ...", ["hook"])
def _():
    def run(ddp):
        ddp.register_comm_hook(None, lambda bucket: _done(bucket.buffer()))
        _train_once(ddp)

    return _single(run)


def _local_sgd(kwargs):
    from gradsync.comm import PostLocalSGD

    return _single(lambda ddp: PostLocalSGD(ddp, **kwargs))


@case("local_sgd_period_zero", CAT, "PostLocalSGD(period=0)", ["period"])
def _():
    return _local_sgd({"period": 0})


@case("local_sgd_period_string", CAT, "PostLocalSGD(period='4')", ["period"])
def _():
    return _local_sgd({"period": "4"})


@case("local_sgd_warmup_negative", CAT, "PostLocalSGD(period=4, warmup_steps=-1)", ["warmup_steps"])
def _():
    return _local_sgd({"period": 4, "warmup_steps": -1})


@case("local_sgd_after_hook", CAT, "PostLocalSGD on a model that already has a comm hook", [("hook", "PostLocalSGD")])
def _():
    from gradsync.comm import PostLocalSGD, bf16_compress_hook

    def run(ddp):
        ddp.register_comm_hook(None, bf16_compress_hook)
        PostLocalSGD(ddp, period=4)

    return _single(run)


@case("quantized_bits_3", CAT, "QuantizedState(bits=3)", ["bits"])
def _():
    from gradsync.comm import QuantizedState

    group1()
    return repr(QuantizedState(bits=3))


@case("diloco_period_zero", CAT, "DiLoCo(period=0)", ["period"])
def _():
    from gradsync.comm import DiLoCo

    return _single(lambda ddp: DiLoCo(ddp, period=0))


@case("quantized_block_zero", CAT, "QuantizedState(block=0)", ["block"])
def _():
    from gradsync.comm import QuantizedState

    group1()
    return repr(QuantizedState(block=0))


@case("diloco_compression_fp8", CAT, "DiLoCo(compression='fp8')", ["compression"])
def _():
    from gradsync.comm import DiLoCo

    def run(ddp):
        return DiLoCo(ddp, period=4, compression="fp8")

    return _single(run)


def _bf16_on_double(rank: int, world: int) -> dict:
    from gradsync.comm import bf16_compress_hook

    net, ref = seeded(lambda: Shallow().double())
    ddp = gradsync.DistributedDataParallel(net)
    ddp.register_comm_hook(None, bf16_compress_hook)
    make = lambda step, r: batch(step, r, dtype=torch.float64)  # noqa: E731
    return train_compare(ddp, ref, rank, world, steps=2, make=make)


@case(
    "bf16_hook_on_float64_model",
    CAT,
    "bf16_compress_hook on a float64 model: bf16 precision expected (checked to 2e-2)",
    check=lambda results: same_and_right(results, tol=2e-2),
)
def _():
    return ranks(_bf16_on_double)
