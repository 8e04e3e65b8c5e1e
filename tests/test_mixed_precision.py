"""Mixed precision (``mixed_precision=gradsync.MixedPrecision(...)`` or torch's ``_MixedPrecision``): two gloo
ranks against a single-process reference that does torch's casts and torch's arithmetic (the parameters cast to
``param_dtype`` as leaves, gradients accumulated in ``param_dtype``, summed then divided by the world size in
``reduce_dtype``, upcast into full-precision master weights), bit for bit. torch's own DDP is not the reference
here: on CPU its ``_MixedPrecision`` needs CUDA events, and with them faked its gradients are garbage (its tests only
compare ranks with each other); its five native-mixed-precision tests run in the conformance suite.

Each spawn runs many cases (a spawn costs seconds here)."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import tempfile
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, distribute_tensor
from torch.nn.parallel.distributed import _MixedPrecision

import gradsync
from gradsync import checkpoint
from gradsync.ddp.mixed_precision import check_mixed_precision_composition
from gradsync.errors import ConfigError
from gradsync.optim import OverlappedOptimizer
from gradsync.testing import spawn, spawn_failures

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
LR = 0.05
WORLD = 2


class Net(nn.Module):
    """Two layers, a floating-point buffer and an integer one, a frozen parameter, and a branch some steps skip."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 4)
        self.extra = nn.Linear(16, 4)
        self.frozen = nn.Parameter(torch.randn(4), requires_grad=False)
        self.register_buffer("scale", torch.full((16,), 0.75))
        self.register_buffer("count", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor, use_extra: bool = True) -> torch.Tensor:
        h = torch.tanh(self.a(x)) * self.scale
        out = self.b(h) + self.frozen
        return out + self.extra(h) if use_extra else out


def _x(rank: int, step: int, micro: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    return torch.randn(6, 8, generator=g)


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean()


@dataclasses.dataclass(frozen=True)
class Case:
    param: torch.dtype | None = BF16
    reduce: torch.dtype | None = None
    ddp: tuple[tuple[str, Any], ...] = ()
    micro: int = 1  # backward passes per step, all but the last under no_sync
    hook: str | None = None  # "bf16" or "allreduce": torch's hooks
    extra_skipped_on: int | None = None  # this rank's forwards skip the extra branch (find_unused_parameters)
    steps: int = 3
    optimizer: str = "sgd"  # or "sharded", "overlapped"

    @property
    def policy(self) -> gradsync.MixedPrecision:
        return gradsync.MixedPrecision(self.param, self.reduce, self.param)


CASES = {
    "bf16": Case(),
    "bf16-reduce-fp32": Case(reduce=FP32),
    "fp16": Case(param=FP16),
    "fp16-reduce-fp32": Case(param=FP16, reduce=FP32),
    "reduce-only-bf16": Case(param=None, reduce=BF16),
    "tiny-buckets": Case(ddp=(("bucket_cap_mb", 0.0003),)),
    "bucket-view": Case(ddp=(("gradient_as_bucket_view", True), ("bucket_cap_mb", 0.0003))),
    "no_sync": Case(micro=3, ddp=(("bucket_cap_mb", 0.0003),)),
    "find-unused": Case(ddp=(("find_unused_parameters", True),), extra_skipped_on=1),
    "static-graph": Case(ddp=(("static_graph", True), ("bucket_cap_mb", 0.0003))),
    "bf16-hook-over-fp32-reduce": Case(reduce=FP32, hook="bf16"),
    "fp32-hook-over-bf16-reduce": Case(hook="allreduce"),
    "sharded-optimizer": Case(optimizer="sharded"),
    "overlapped-optimizer": Case(optimizer="overlapped", ddp=(("bucket_cap_mb", 0.0003),)),
}


def _reference_grads(master: Net, case: Case, step: int) -> list[torch.Tensor | None]:
    """torch's DDP's arithmetic in one process: each rank's gradients in param_dtype (accumulated there), summed,
    then divided, in the reduce dtype, upcast."""
    dtype = case.param or FP32
    reduce = case.reduce or dtype
    if case.hook == "bf16":
        # bf16_compress_hook: each bucket (reduce dtype) cast to bf16 and halved (exact), summed in bf16, copied
        # back: over 2 ranks, the same values as summing then halving in bf16.
        reduce = BF16
    per_rank = []
    for rank in range(WORLD):
        low = copy.deepcopy(master).to(dtype)  # leaves in param_dtype, as torch's swapped .data
        low.count.zero_()
        for micro in range(case.micro):
            _loss(low(_x(rank, step, micro).to(dtype), use_extra=rank != case.extra_skipped_on)).backward()
        per_rank.append([p.grad for p in low.parameters()])
    grads: list[torch.Tensor | None] = []
    for column in zip(*per_rank):
        present = [g for g in column if g is not None]  # a rank that did not use it contributes zeros
        if not present:
            grads.append(None)
            continue
        total = torch.zeros_like(present[0], dtype=reduce)
        for g in present:
            total = total + g.to(reduce)
        grads.append((total / WORLD).to(FP32))
    return grads


def reference(case: Case) -> dict[str, torch.Tensor]:
    master = Net()
    opt = torch.optim.SGD([p for p in master.parameters() if p.requires_grad], lr=LR)
    for step in range(case.steps):
        for p, g in zip(master.parameters(), _reference_grads(master, case, step)):
            p.grad = g
        opt.step()
    return {n: p.detach().clone() for n, p in master.named_parameters()}


def _optimizer(case: Case, ddp: gradsync.DistributedDataParallel) -> Any:
    if case.optimizer == "sharded":
        return gradsync.ShardedOptimizer(ddp.parameters(), torch.optim.SGD, lr=LR)
    if case.optimizer == "overlapped":
        return OverlappedOptimizer(ddp, torch.optim.SGD, lr=LR)
    return torch.optim.SGD([p for p in ddp.parameters() if p.requires_grad], lr=LR)


def _train(rank: int, case: Case) -> dict[str, Any]:
    ddp = gradsync.DistributedDataParallel(Net(), mixed_precision=case.policy, **dict(case.ddp))
    if case.hook == "bf16":
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif case.hook == "allreduce":
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    opt = _optimizer(case, ddp)
    seen: dict[str, Any] = {}
    for step in range(case.steps):
        for micro in range(case.micro):
            synced = micro == case.micro - 1
            with ddp.no_sync() if not synced else contextlib.nullcontext():
                out = ddp(_x(rank, step, micro), use_extra=rank != case.extra_skipped_on)
                _loss(out).backward()
        seen["grad_dtypes"] = {str(p.grad.dtype) for p in ddp.parameters() if p.grad is not None}
        seen["param_dtypes"] = {str(p.dtype) for p in ddp.parameters()}
        opt.step()
        opt.zero_grad()
    seen["params"] = {n: p.detach().clone() for n, p in ddp.module.named_parameters()}
    seen["buffers"] = {n: str(b.dtype) for n, b in ddp.module.named_buffers()}
    seen["state_dict"] = {k: str(v.dtype) for k, v in ddp.state_dict().items()}
    return seen


def run_cases(rank: int, world_size: int, names: list[str]) -> dict[str, Any]:
    return {name: _train(rank, CASES[name]) for name in names}


@pytest.mark.timeout(300)
def test_matches_torchs_arithmetic_in_one_process() -> None:
    names = list(CASES)
    results = spawn(run_cases, world_size=WORLD, args=(names,), timeout=280)
    for name in names:
        case = CASES[name]
        expected = reference(case)
        for rank, result in enumerate(results):
            seen = result[name]
            assert seen["grad_dtypes"] == {"torch.float32"}, (name, rank)
            assert seen["param_dtypes"] == {"torch.float32"}, (name, rank)
            for n, value in expected.items():
                assert torch.equal(seen["params"][n], value), (name, rank, n, (seen["params"][n] - value).abs().max())
            buffer_dtype = str(case.param) if case.param is not None else "torch.float32"
            assert seen["buffers"] == {"scale": buffer_dtype, "count": "torch.int64"}, (name, seen["buffers"])
            assert {v for k, v in seen["state_dict"].items() if "scale" not in k and "count" not in k} == {
                "torch.float32"
            }


def _same_batch_everywhere(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    ddp = gradsync.DistributedDataParallel(Net(), mixed_precision=gradsync.MixedPrecision(BF16, buffer_dtype=BF16))
    _loss(ddp(_x(0, 0))).backward()
    return {n: p.grad.clone() for n, p in ddp.module.named_parameters() if p.grad is not None}


@pytest.mark.timeout(120)
def test_three_ranks_sum_then_divide_in_the_reduce_dtype() -> None:
    """torch sums, then divides by the world size, both in the reduce dtype; gradsync's default divides on the way
    into the bucket. Over 3 ranks (1/3 rounds) the two differ; every rank has the same gradient, so the sum's order
    cannot matter."""
    results = spawn(_same_batch_everywhere, world_size=3, timeout=100)
    low = Net().to(BF16)
    _loss(low(_x(0, 0).to(BF16))).backward()
    for n, p in low.named_parameters():
        if p.grad is not None:
            expected = ((p.grad + p.grad + p.grad) / 3).to(FP32)
            for result in results:
                assert torch.equal(result[n], expected), n


# ---------------------------------------------------------------------------------- join and checkpoints
def _join_and_checkpoint(rank: int, world_size: int, path: str) -> dict[str, Any]:
    policy = _MixedPrecision(param_dtype=BF16, reduce_dtype=FP32, buffer_dtype=BF16)  # torch's own dataclass
    ddp = gradsync.DistributedDataParallel(Net(), mixed_precision=policy)
    opt = torch.optim.SGD([p for p in ddp.parameters() if p.requires_grad], lr=LR)
    with ddp.join():
        for step in range(3 if rank == 0 else 2):  # rank 1 runs out of data a step early
            _loss(ddp(_x(rank, step))).backward()
            opt.step()
            opt.zero_grad()
    joined = {n: p.detach().clone() for n, p in ddp.module.named_parameters()}
    checkpoint.save(path, model=ddp, optimizer=opt, step=3)
    fresh = gradsync.DistributedDataParallel(Net(), mixed_precision=policy)
    fresh_opt = torch.optim.SGD([p for p in fresh.parameters() if p.requires_grad], lr=LR)
    checkpoint.restore(checkpoint.load(path), model=fresh, optimizer=fresh_opt)
    saved = checkpoint.load(path)["model"]
    for model, optimizer in ((ddp, opt), (fresh, fresh_opt)):  # one more step each: the resumed one continues alike
        _loss(model(_x(rank, 9))).backward()
        optimizer.step()
    return {
        "joined": joined,
        "saved_dtypes": {k: str(v.dtype) for k, v in saved.items()},
        "continued": {n: p.detach().clone() for n, p in ddp.module.named_parameters()},
        "resumed": {n: p.detach().clone() for n, p in fresh.module.named_parameters()},
    }


def _reference_join() -> dict[str, torch.Tensor]:
    """The joined rank contributes zeros and the average divides by the initial world size (join's default)."""
    master = Net()
    opt = torch.optim.SGD([p for p in master.parameters() if p.requires_grad], lr=LR)
    for step in range(3):
        per_rank = []
        for rank in range(WORLD if step < 2 else 1):
            low = copy.deepcopy(master).to(BF16)
            _loss(low(_x(rank, step).to(BF16))).backward()
            per_rank.append([p.grad for p in low.parameters()])
        for k, p in enumerate(master.parameters()):
            if p.requires_grad:
                p.grad = sum((g[k].to(FP32) for g in per_rank), torch.zeros_like(p)) / WORLD
        opt.step()
    return {n: p.detach().clone() for n, p in master.named_parameters()}


@pytest.mark.timeout(200)
def test_join_and_checkpoint_round_trip() -> None:
    with tempfile.TemporaryDirectory() as directory:
        results = spawn(_join_and_checkpoint, world_size=WORLD, args=(f"{directory}/mp.pt",), timeout=180)
    expected = _reference_join()
    for result in results:
        for n, value in expected.items():
            assert torch.equal(result["joined"][n], value), n
        assert {v for k, v in result["saved_dtypes"].items() if k != "scale" and not k.startswith("_")} >= {
            "torch.float32"
        }
        assert result["saved_dtypes"]["a.weight"] == "torch.float32"
        for n in expected:
            assert torch.equal(result["continued"][n], result["resumed"][n]), n


# ---------------------------------------------------------------------------------- one process
def test_policy_is_checked_at_the_boundary() -> None:
    with pytest.raises(ConfigError, match="param_dtype=torch.int8 is not a floating-point dtype"):
        gradsync.MixedPrecision(param_dtype=torch.int8)
    with pytest.raises(ConfigError, match="reduce_dtype must be a torch.dtype"):
        gradsync.MixedPrecision(reduce_dtype="bf16")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="buffer_dtype=torch.int64"):
        gradsync.MixedPrecision(buffer_dtype=torch.int64)
    with pytest.raises(ConfigError, match="cast_forward_inputs must be True or False"):
        gradsync.MixedPrecision(cast_forward_inputs=1)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="mixed_precision must be a gradsync.MixedPrecision"):
        gradsync.MixedPrecision.of(torch.bfloat16)
    assert gradsync.MixedPrecision.of(_MixedPrecision(param_dtype=BF16)) == gradsync.MixedPrecision(BF16)
    ours = inspect.signature(gradsync.DistributedDataParallel.__init__).parameters
    assert set(inspect.signature(torch.nn.parallel.DistributedDataParallel.__init__).parameters) <= set(ours)


def test_forward_computes_in_low_precision_and_leaves_full_precision(group_of_one: None) -> None:
    seen: dict[str, Any] = {}

    class Probe(Net):
        def forward(self, x: torch.Tensor, use_extra: bool = True) -> torch.Tensor:
            seen["params"] = {str(p.dtype) for p in self.parameters()}
            seen["input"] = x.dtype
            return super().forward(x, use_extra)

    ddp = gradsync.DistributedDataParallel(Probe(), mixed_precision=gradsync.MixedPrecision(BF16, FP32, BF16))
    assert ddp.module.scale.dtype == BF16 and ddp.module.count.dtype == torch.long  # only floating buffers cast
    _loss(ddp(_x(0, 0))).backward()
    assert seen == {"params": {"torch.bfloat16"}, "input": BF16}
    trained = [p for p in ddp.parameters() if p.requires_grad]
    for p in trained:
        p.grad.mul_(1 + 2**-12)  # (a gradient clipped, say): no longer a bfloat16 value, so rounding would show
    kept = [p.grad.clone() for p in trained]
    with torch.no_grad():  # an evaluation forward before the step leaves .grad as it is
        ddp(_x(0, 1))
    assert all(torch.equal(p.grad, g) for p, g in zip(trained, kept))  # (the no_sync case checks the rounding)
    assert {p.dtype for p in ddp.parameters()} == {FP32}
    assert {p.grad.dtype for p in ddp.parameters() if p.requires_grad} == {FP32}
    assert all(isinstance(p, nn.Parameter) for p in ddp.module.parameters())
    assert ddp.module.state_dict()["a.weight"].dtype == FP32
    assert ddp.module.a.weight._mp_param.dtype == BF16 and ddp.module.a.weight._fp_param.dtype == FP32  # torch's
    no_cast = gradsync.DistributedDataParallel(
        Probe(), mixed_precision=gradsync.MixedPrecision(BF16, buffer_dtype=BF16, cast_forward_inputs=False)
    )
    with torch.no_grad():
        no_cast(_x(0, 0).to(BF16))
    assert seen["input"] == BF16


def test_refused_combinations_name_what_to_do_and_a_regroup_keeps_the_policy(group_of_one: None) -> None:
    policy = gradsync.MixedPrecision(BF16, buffer_dtype=BF16)
    sparse = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2))
    with pytest.raises(ConfigError, match=r"sparse gradients \(parameter '0.weight'.*sparse=False"):
        gradsync.DistributedDataParallel(sparse, mixed_precision=policy)
    with pytest.raises(ConfigError, match=r"mixed_precision with SyncBatchNorm \(module '1'"):
        norm = nn.Sequential(nn.Linear(4, 4), gradsync.SyncBatchNorm(4))
        gradsync.DistributedDataParallel(norm, mixed_precision=policy)
    with pytest.raises(ConfigError, match="mixed_precision must be a gradsync.MixedPrecision"):
        gradsync.DistributedDataParallel(Net(), mixed_precision="bf16")
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    sharded = nn.Linear(4, 4)
    sharded.weight = nn.Parameter(distribute_tensor(sharded.weight.detach(), mesh["tp"], [Replicate()]))
    with pytest.raises(ConfigError, match=r"DTensor parameters \(tensor parallelism; parameter 'weight'\)"):
        check_mixed_precision_composition(sharded, frozenset())  # DDP checks the mesh first
    ddp = gradsync.DistributedDataParallel(Net(), mixed_precision=policy)
    ddp.rebuild_for_new_group()  # elastic recovery rebuilds the runtime: the policy with it
    _loss(ddp(_x(0, 0))).backward()
    assert {p.grad.dtype for p in ddp.parameters() if p.requires_grad} == {FP32}
    assert ddp.reducer.layout.casts and ddp.module.scale.dtype == BF16
    copied = copy.deepcopy(ddp)  # pickled state: the policy, rebuilt with the copy's runtime
    assert copied.mixed_precision == policy and copied.reducer.layout.casts
    with ddp.no_sync():
        out = ddp(_x(0, 0))
    with pytest.raises(ConfigError, match=r"mixed_precision with sync_next_backward"):
        ddp.sync_next_backward(out)


# ---------------------------------------------------------------------------------- torch.compile
def _compiled_variants(rank: int, world_size: int) -> dict[str, Any]:
    from test_compile import BATCH, WIDTH, _wrap
    from test_compile import Net as LayerNet

    results: dict[str, Any] = {}
    for order in ("eager", "outer", "inner"):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = LayerNet(layers=4)
        policy = gradsync.MixedPrecision(BF16, FP32)
        ddp, run = _wrap("gradsync", order, model, {"bucket_cap_mb": 1, "mixed_precision": policy}, "aot_eager", False)
        first = model.layers[0].weight
        early: list[bool] = []

        def recording_hook(state, bucket, early=early, first=first):  # type: ignore[no-untyped-def]
            early.append(first.grad is None)  # handed over before the first layer's gradient existed
            return default_hooks.allreduce_hook(None, bucket)

        ddp.register_comm_hook(None, recording_hook)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        frames, overlapped = [], []
        for step in range(3):
            opt.zero_grad(set_to_none=True)
            early.clear()
            x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(10 * step + rank))
            run(x).float().pow(2).mean().backward()
            opt.step()
            frames.append(ddp._forward_steps.graph_split.frames_split)
            overlapped.append((sum(early), len(early)))
        results[order] = {
            "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "frames": frames,
            "overlapped": overlapped,
            "grad_dtypes": {str(p.grad.dtype) for p in model.parameters()},
        }
    return results


@pytest.mark.timeout(400)
def test_compiled_in_both_orders_matches_eager_and_overlaps() -> None:
    for result in spawn(_compiled_variants, world_size=WORLD, timeout=380):
        eager = result["eager"]["state"]
        for order in ("outer", "inner"):
            seen = result[order]
            for k, value in eager.items():
                assert torch.equal(seen["state"][k], value), (order, k)
            assert seen["grad_dtypes"] == {"torch.float32"}
            assert seen["frames"][0] > 0 and len(set(seen["frames"])) == 1, (order, seen["frames"])  # no recompile
            for early, buckets in seen["overlapped"][1:]:
                assert early >= buckets - 2, (order, seen["overlapped"])


# ---------------------------------------------------------------------------------- check_for_nan_in_grad
def _inf_on_rank1(rank: int, world_size: int, policy: gradsync.MixedPrecision | None) -> None:
    ddp = gradsync.DistributedDataParallel(
        Net(), mixed_precision=policy, check_for_nan_in_grad=True, bucket_cap_mb=0.0003
    )
    for step in range(2):  # a finite step first: the check lets it through, as it does the rebuilt buckets
        x = _x(rank, step)
        if step == 1 and rank == 1:
            x[0, 0] = float("inf")
        _loss(ddp(x)).backward()
        ddp.zero_grad()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("policy", [None, gradsync.MixedPrecision(FP16, buffer_dtype=FP16)], ids=["fp32", "fp16"])
def test_a_non_finite_gradient_is_named_before_it_is_averaged(policy: gradsync.MixedPrecision | None) -> None:
    failures = spawn_failures(_inf_on_rank1, args=(policy,), timeout=100, pg_timeout=10)
    assert failures[1].kind == "GradientError"
    assert "rank 1: parameter 'a.weight'" in failures[1].message and "NaN or inf gradient" in failures[1].message
    assert "rank 1 reported" in failures[0].message  # rank 0, in that bucket's all-reduce, gets rank 1's report
