"""The prepared GPU check (``bash tests/gpu/run.sh``): gradsync against torch's DDP on CUDA, one test per item.

Two gloo ranks share the GPU (gloo carries CUDA tensors; NCCL needs a GPU per rank, checked where two exist), so one
GPU shows the CUDA path: buckets on the device, the streams hooks complete on, autocast and GradScaler, compiled
graphs, memory and host syncs. Without a GPU each test skips and says so; the default suite runs this file too.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from ddp_cases import BATCH, batch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

import gradsync
from gradsync.comm import QuantizedState, quantized_hook
from gradsync.testing import spawn
from lab.zoo.toys import IN, OUT, build

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
needs_gpu = pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU (run bash tests/gpu/run.sh on one)")
needs_two = pytest.mark.skipif(GPUS < 2, reason="NCCL needs one GPU per rank: 2 GPUs")
STEPS = 4

MODES = {
    # name: (model, DDP keyword arguments)
    "default": ("mlp", {"bucket_cap_mb": 0.0005}),
    "bucket_view": ("mlp", {"bucket_cap_mb": 0.0005, "gradient_as_bucket_view": True}),
    "find_unused": ("sometimes", {"bucket_cap_mb": 0.0005, "find_unused_parameters": True}),
    "static_graph": ("mlp", {"bucket_cap_mb": 0.0005, "static_graph": True}),
    "buffers": ("bn", {"bucket_cap_mb": 0.0005}),
    "amp_grad_scaler": ("mlp", {"bucket_cap_mb": 0.0005}),
    "fp16_hook": ("mlp", {"bucket_cap_mb": 0.0005}),
    "powersgd_hook": ("mlp", {"bucket_cap_mb": 1000}),  # one bucket: see tests/test_compile.py
    # torch's DDPOptimizer asserts that its 1 MiB first piece is no larger than the cap (torch 2.11 on CUDA).
    "compile": ("mlp", {"bucket_cap_mb": 1}),
}


def _device(rank: int) -> torch.device:
    return torch.device("cuda", rank % torch.cuda.device_count())


def _hooked(ddp: nn.Module, mode: str) -> None:
    if mode == "fp16_hook":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif mode == "powersgd_hook":
        state = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2, random_seed=0)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)


def _train_one(rank: int, world: int, impl: str, mode: str, device_ids: bool) -> dict[str, torch.Tensor]:
    device = _device(rank)
    model_name, kwargs = MODES[mode]
    module = build(model_name).to(device)
    wrapped = torch.compile(module) if mode == "compile" else module
    ddp_class = gradsync.DistributedDataParallel if impl == "gradsync" else nn.parallel.DistributedDataParallel
    ddp = ddp_class(wrapped, device_ids=[device.index] if device_ids else None, **kwargs)
    _hooked(ddp, mode)
    opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    amp = mode == "amp_grad_scaler"
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**16, enabled=amp)
    extra = {"use_extra": rank == 0} if model_name == "sometimes" else {}
    for step in range(STEPS):
        x, y = batch(step, 0, world)
        sl = slice(rank * BATCH, (rank + 1) * BATCH)
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.float16, enabled=amp):
            loss = nn.functional.mse_loss(ddp(x[sl].to(device), **extra).float(), y[sl].to(device))
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    if impl == "gradsync":
        assert all(b.buffer.device == device for b in ddp.reducer.buckets)
    return {k: v.detach().cpu() for k, v in module.state_dict().items()}


def _parity(rank: int, world: int, mode: str, device_ids: bool) -> float:
    torch._dynamo.reset()
    ours = _train_one(rank, world, "gradsync", mode, device_ids)
    torch._dynamo.reset()
    theirs = _train_one(rank, world, "torch", mode, device_ids)
    return max((ours[k].double() - theirs[k].double()).abs().max().item() for k in ours)


@needs_gpu
@pytest.mark.parametrize("mode", list(MODES))
def test_parity_with_torch_on_cuda(mode: str) -> None:
    tol = 1e-4 if mode in ("amp_grad_scaler", "fp16_hook", "compile") else 1e-5
    diffs = spawn(_parity, 2, args=(mode, False), timeout=240)
    assert max(diffs) <= tol, f"{mode}: gradsync vs torch's DDP on CUDA differ by {max(diffs):.3g}"


@needs_two
def test_nccl_two_ranks_with_device_ids() -> None:
    diffs = spawn(_parity, 2, args=("default", True), timeout=240, backend="nccl")
    assert max(diffs) <= 1e-5, diffs


# ------------------------------------------------------------- the quantized hook's future, with a slow callback
def _quantized(rank: int, world: int, slow: bool) -> list[torch.Tensor]:
    """The averaging kernels run on the all-gather callback's stream; made slow on purpose, a future that recorded
    no event would let the copy into .grad read the bucket before they finish."""
    from gradsync.comm import quantized

    device = _device(rank)
    if slow:
        real = quantized._unpacker

        def slow_unpacker(*args):  # type: ignore[no-untyped-def]
            unpack = real(*args)

            def delayed(fut):  # type: ignore[no-untyped-def]
                torch.cuda._sleep(50_000_000)  # ~25 ms of GPU time ahead of the averaging kernels
                return unpack(fut)

            return delayed

        quantized._unpacker = slow_unpacker
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(IN, 512), nn.Tanh(), nn.Linear(512, OUT)).to(device)
    ddp = gradsync.DistributedDataParallel(module, bucket_cap_mb=0.1)
    ddp.register_comm_hook(QuantizedState(None, bits=8), quantized_hook)
    x, y = batch(0, 0, world)
    nn.functional.mse_loss(ddp(x[rank * BATCH : (rank + 1) * BATCH].to(device)), y[:BATCH].to(device)).backward()
    return [p.grad.cpu() for p in module.parameters()]


@needs_gpu
def test_quantized_hook_with_a_slow_callback_gives_the_same_gradients() -> None:
    fast = spawn(_quantized, 2, args=(False,), timeout=120)
    slow = spawn(_quantized, 2, args=(True,), timeout=120)
    for rank in range(2):
        for a, b in zip(fast[rank], slow[rank]):
            assert torch.equal(a, b), "the copy into .grad did not wait for the callback's kernels"
    assert all(torch.equal(a, b) for a, b in zip(slow[0], slow[1])), "the replicas got different averages"


# ---------------------------------------------------------------------------------- SyncBatchNorm under fp16
def _sync_bn_half(rank: int, world: int) -> dict[str, torch.Tensor]:
    device = _device(rank)
    torch.manual_seed(0)
    bn = gradsync.SyncBatchNorm(8).to(device)
    g = torch.Generator().manual_seed(rank)
    x = (torch.randn(8, 8, 96, 96, generator=g) * 2 + 1).to(device).requires_grad_(True)
    with torch.autocast("cuda", dtype=torch.float16):
        y = bn(x.half())
    (y.float() * 1e-3).sum().backward()
    return {"y": y.detach().float().cpu(), "dx": x.grad.cpu(), "var": bn.running_var.cpu()}


@needs_gpu
def test_sync_batchnorm_fp16_matches_batchnorm_on_the_global_batch() -> None:
    """Against torch's BatchNorm2d over both ranks' batches in one process under the same autocast (torch's own
    SyncBatchNorm needs NCCL); 147,456 values per channel, past float16's largest count."""
    got = spawn(_sync_bn_half, 2, timeout=120)
    torch.manual_seed(0)
    bn = nn.BatchNorm2d(8).cuda()
    xs = [(torch.randn(8, 8, 96, 96, generator=torch.Generator().manual_seed(r)) * 2 + 1) for r in range(2)]
    x = torch.cat(xs).cuda().requires_grad_(True)
    with torch.autocast("cuda", dtype=torch.float16):
        y = bn(x.half())
    (y.float() * 1e-3).sum().backward()
    for rank in range(2):
        assert torch.isfinite(got[rank]["var"]).all()
        torch.testing.assert_close(got[rank]["var"], bn.running_var.cpu(), rtol=1e-3, atol=1e-3)
        sl = slice(8 * rank, 8 * (rank + 1))
        torch.testing.assert_close(got[rank]["y"], y.detach().float().cpu()[sl], rtol=0, atol=1e-2)
        torch.testing.assert_close(got[rank]["dx"], x.grad.cpu()[sl], rtol=0, atol=1e-5)


# ------------------------------------------------------------------------------ ShardedOptimizer vs torch ZeRO
def _sharded(rank: int, world: int, impl: str) -> dict[str, torch.Tensor]:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    device = _device(rank)
    module = build("mlp").to(device)
    ddp = gradsync.DistributedDataParallel(module, bucket_cap_mb=0.0005)
    if impl == "gradsync":
        opt = gradsync.ShardedOptimizer(module.parameters(), optimizer_class=torch.optim.Adam, lr=1e-2)
    else:
        opt = ZeroRedundancyOptimizer(module.parameters(), optimizer_class=torch.optim.Adam, lr=1e-2)
    for step in range(STEPS):
        x, y = batch(step, 0, world)
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x[rank * BATCH : (rank + 1) * BATCH].to(device)), y[:BATCH].to(device)).backward()
        opt.step()
    return {k: v.detach().cpu() for k, v in module.state_dict().items()}


@needs_gpu
def test_sharded_optimizer_matches_zero_redundancy_optimizer() -> None:
    ours = spawn(_sharded, 2, args=("gradsync",), timeout=120)
    theirs = spawn(_sharded, 2, args=("torch",), timeout=120)
    for a, b in zip(ours, theirs):
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-5)


# ------------------------------------------------------------------------- host syncs and memory, vs torch's
def _steady_steps(rank: int, impl: str, measure: str) -> float:
    device = _device(rank)
    torch.manual_seed(0)
    width = 2048 if measure == "memory" else 256
    module = nn.Sequential(*[nn.Linear(width, width) for _ in range(8)]).to(device)
    ddp_class = gradsync.DistributedDataParallel if impl == "gradsync" else nn.parallel.DistributedDataParallel
    ddp = ddp_class(module)
    opt = torch.optim.SGD(module.parameters(), lr=1e-3)
    x = torch.randn(16, width, device=device)
    for _ in range(16):  # past the rebuild and the tuner's trial
        opt.zero_grad(set_to_none=True)
        ddp(x).sum().backward()
        opt.step()
    if impl == "gradsync":
        assert ddp.reducer.tuning is None, "the tuner ran on CUDA, where its host timings are launch times"
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(device)
    caught: contextlib.AbstractContextManager = warnings.catch_warnings(record=True)
    with caught as records:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        for _ in range(4):
            opt.zero_grad(set_to_none=True)
            ddp(x).sum().backward()
            opt.step()
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    if measure == "memory":
        return float(torch.cuda.max_memory_allocated(device))
    return sum("synchronizing" in str(r.message) for r in records or []) / 4


def _steady(rank: int, world: int, impl: str, measure: str) -> float:
    return _steady_steps(rank, impl, measure)


def _measure(measure: str) -> tuple[float, float]:
    """gradsync's figure and torch's, each in processes of its own (nothing of one is alive during the other)."""
    ours = spawn(_steady, 2, args=("gradsync", measure), timeout=150)[0]
    return ours, spawn(_steady, 2, args=("torch", measure), timeout=150)[0]


@needs_gpu
def test_host_syncs_per_steady_step_are_no_more_than_torchs() -> None:
    ours, theirs = _measure("syncs")
    print(f"host syncs per step: gradsync {ours:.1f}, torch's DDP {theirs:.1f}")
    assert ours <= theirs, f"gradsync syncs the host {ours} times a step, torch's DDP {theirs}"


@needs_gpu
def test_memory_after_the_rebuild_is_within_5_percent_of_torchs() -> None:
    ours, theirs = _measure("memory")
    print(f"peak GPU memory in steady steps: gradsync {ours / 2**20:.0f} MiB, torch's DDP {theirs / 2**20:.0f} MiB")
    assert ours <= 1.05 * theirs, f"gradsync {ours / 2**20:.0f} MiB vs torch's {theirs / 2**20:.0f} MiB"


# ------------------------------------------------------------------ a missing gradient, named in its own step
def _missing_gradient(rank: int, world: int) -> str:
    device = _device(rank)
    model = nn.ModuleDict({"used": nn.Linear(8, 8), "never": nn.Linear(8, 8)}).to(device)
    ddp = gradsync.DistributedDataParallel(_UsesOne(model))
    try:
        ddp(torch.randn(4, 8, device=device)).sum().backward()
    except gradsync.errors.GradientError as error:
        return str(error)
    return "no error in the backward that missed the gradients"


class _UsesOne(nn.Module):
    def __init__(self, parts: nn.ModuleDict) -> None:
        super().__init__()
        self.parts = parts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.parts["used"](x)


@needs_gpu
def test_a_missing_gradient_is_named_in_the_backward_that_missed_it() -> None:
    # On CUDA the engine ends the backward on its device thread; it must not be mistaken for a nested one.
    messages = spawn(_missing_gradient, 2, timeout=120)
    for message in messages:
        assert "parts.never.weight" in message, message


# ------------------------------------------------------------ the Monitor and the tuner time the GPU's work
def _gpu_timeline(rank: int, world: int) -> tuple[float, float, bool]:
    import time

    from gradsync.observe import Monitor

    device = _device(rank)
    torch.manual_seed(0)
    module = nn.Sequential(*[nn.Linear(4096, 4096) for _ in range(6)]).to(device)
    ddp = gradsync.DistributedDataParallel(module, bucket_cap_mb="auto")  # the tuner, asked for on CUDA
    opt = torch.optim.SGD(module.parameters(), lr=1e-4)
    monitor = Monitor(ddp, opt)
    x = torch.randn(512, 4096, device=device)
    walls = []
    for _ in range(16):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        ddp(x).square().mean().backward()
        opt.step()
        torch.cuda.synchronize(device)
        walls.append(time.perf_counter() - start)
    recorded = [s.optimizer_end - s.forward_start for s in monitor.steps[-4:]]
    tuning = ddp.reducer.tuning
    trial_timed = tuning is None or tuning.trial is None or tuning.trial.default_s > 0
    return sorted(recorded)[2], sorted(walls[-4:])[2], tuning is not None and trial_timed


@needs_gpu
def test_monitor_and_tuner_time_the_gpu_not_the_launches() -> None:
    # Host timestamps on CUDA are launch times: a step would look a fraction of what the GPU took.
    recorded, wall, tuned = spawn(_gpu_timeline, 2, timeout=150)[0]
    print(f"step recorded by the Monitor {recorded * 1e3:.1f} ms, host wall with synchronize {wall * 1e3:.1f} ms")
    assert recorded >= 0.7 * wall, f"the Monitor saw {recorded * 1e3:.1f} ms of a {wall * 1e3:.1f} ms step"
    assert tuned, "bucket_cap_mb='auto' on CUDA made no timed decision"


# ------------------------------------------------------------------------- a stuck NCCL collective, named
def _one_rank_never_arrives(rank: int, world: int, stderr_path: str) -> None:
    import os
    import time

    if rank == 1:
        time.sleep(40)  # never issues the all-reduce; NCCL's watchdog ends rank 0 at the 12 s timeout
        return
    fd = os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 2)  # what rank 0 says before the watchdog ends it
    module = nn.Linear(64, 64).cuda()
    from gradsync.collectives import Communicator, Op

    comm = Communicator(None, device=next(module.parameters()).device)
    future = comm.all_reduce_async(Op.BUCKET_ALLREDUCE, module.weight.detach(), 0)
    comm.wait(future, Op.BUCKET_ALLREDUCE, 0)
    torch.cuda.synchronize()  # stuck here until the watchdog acts
    time.sleep(30)


@needs_two
def test_a_stuck_nccl_collective_is_named_before_the_watchdog_ends_the_process(tmp_path) -> None:  # type: ignore[no-untyped-def]
    said = tmp_path / "rank0.stderr"
    with contextlib.suppress(Exception):
        spawn(_one_rank_never_arrives, 2, args=(str(said),), timeout=60, pg_timeout=12, backend="nccl")
    text = said.read_text()
    print(text[-2000:])
    assert "gradsync: all-reduce of bucket 0 failed on rank 0: still running after" in text, text[-2000:]


# ------------------------------------------------------------------------- an elastic job with its model on CUDA
def kill_and_rejoin(device: str, out) -> dict:  # type: ignore[no-untyped-def]
    """``gradsync run --elastic`` with 2 workers on this host (tests/scripts/elastic_train.py, its model and batches
    on ``device``), one SIGKILLed mid-epoch: the survivor goes on in its process, the launcher restarts the victim,
    which joins again; every sample is used once and both end with the same model. What the job logged, with the
    finals. The same training script kills and rejoins on CPU in tests/test_elastic.py (on the namespace lab)."""
    import os
    import signal

    from lab.elastic import check_exactly_once, finals, finish, kill_all, launch_on_loopback, wait_steps

    job = launch_on_loopback(out, None, {"DEVICE": device, "STEP_SLEEP": "0.05", "ELASTIC_TIMEOUT": "10"})
    try:
        wait_steps(out, 15)
        victim = max(int(p.stem) for p in out.glob("*.pid"))
        os.kill(victim, signal.SIGKILL)
        logs = finish([job], timeout=240)
    finally:
        kill_all([job], out)
    check_exactly_once(out, killed=1, hosts=2)
    ended = finals(out)
    assert len(ended) == 2 and len({round(f["checksum"], 6) for f in ended}) == 1, ended
    return {"logs": logs, "finals": ended, "victim": victim}


@needs_gpu
@pytest.mark.timeout(300)
def test_an_elastic_job_on_cuda_survives_a_kill_and_the_rejoin(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # Two workers share the GPU, so each round's group is gloo (NCCL needs a GPU per rank): the buckets' CUDA
    # tensors go through gloo's host copies. docs/elastic.md says what has and has not run on NCCL.
    run = kill_and_rejoin("cuda", tmp_path)
    print(run["logs"][0][-1500:])
    assert any(r for f in run["finals"] for r in f["recoveries"]), "no recovery was recorded"
