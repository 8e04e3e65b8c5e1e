"""Bad input and faults: nothing silently wrong, nothing hangs, every error names what is wrong and what to do
(one case per finding of the adversarial sweep in bench/sweep/)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import gradsync
from gradsync.errors import CheckpointError, CollectiveError, ConfigError, DesyncError, ModelMismatchError
from gradsync.runtime import checkpoint
from gradsync.runtime.env import discover
from gradsync.testing import spawn, spawn_failures

SCRIPTS = Path(__file__).parent / "scripts"


class WithBuffer(nn.Module):
    def __init__(self, shape: tuple[int, ...] = (3,), dtype: torch.dtype = torch.float32, extra: bool = False):
        super().__init__()
        self.fc = nn.Linear(4, 1)
        self.register_buffer("stat", torch.ones(shape, dtype=dtype))
        if extra:
            self.register_buffer("extra", torch.zeros(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def _buffers_differ(rank: int, world_size: int, how: str) -> None:
    kwargs = {
        "dtype": {"dtype": torch.float64 if rank == 1 else torch.float32},
        "shape": {"shape": (5,) if rank == 1 else (3,)},
        "extra1": {"extra": rank == 1},
        "extra0": {"extra": rank == 0},
    }[how]
    gradsync.DistributedDataParallel(WithBuffer(**kwargs))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["dtype", "shape", "extra1", "extra0"])
def test_buffers_that_differ_between_ranks_are_refused_on_every_rank(how: str) -> None:
    failures = spawn_failures(_buffers_differ, args=(how,), timeout=50, pg_timeout=10)
    assert sorted(failures) == [0, 1]  # refused everywhere: no rank crashes or trains on misaligned bytes
    for f in failures.values():
        assert (
            f.kind == "ModelMismatchError"
            and "buffer #" in f.message
            and "'stat'" in f.message
            or "'extra'" in f.message
        )


def test_rank_without_world_size_and_garbage_ranks_are_refused() -> None:
    with pytest.raises(ConfigError, match="RANK is set but WORLD_SIZE is not"):
        discover({"RANK": "0"})
    with pytest.raises(ConfigError, match="WORLD_SIZE is set but RANK is not"):
        discover({"WORLD_SIZE": "2"})


def test_garbage_rank_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "abc")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="RANK='abc' is not an integer"):
        gradsync.init()


def _sharded_order(rank: int, world_size: int) -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    params = list(model.parameters())
    gradsync.ShardedOptimizer(params if rank == 0 else params[::-1], optimizer_class=torch.optim.SGD, lr=0.1)


@pytest.mark.timeout(60)
def test_sharded_optimizer_refuses_parameters_in_another_order() -> None:
    for f in spawn_failures(_sharded_order, timeout=50, pg_timeout=10).values():
        assert f.kind == "ConfigError" and "same order on every rank" in f.message


def _save_on_rank0_only(rank: int, world_size: int, path: str) -> float:
    checkpoint.ARRIVAL_SECONDS = 3.0
    start = time.monotonic()
    if rank == 0:
        checkpoint.save(path, step=1)
    else:
        time.sleep(8)  # rank 1 never calls save
    return time.monotonic() - start


@pytest.mark.timeout(60)
def test_saving_on_rank0_only_says_every_rank_must_call_save(tmp_path: Path) -> None:
    failures = spawn_failures(_save_on_rank0_only, args=(str(tmp_path / "c.pt"),), timeout=50, pg_timeout=30)
    assert list(failures) == [0]
    assert failures[0].kind == "CollectiveError"
    assert "rank(s) [1] did not reach gradsync.checkpoint.save within 3s" in failures[0].message
    assert "Every rank must call gradsync.checkpoint.save" in failures[0].message


def _never_completes(state, bucket):
    return torch.futures.Future()  # nobody will ever set it


def _wrong_shape(state, bucket):
    fut = torch.futures.Future()
    fut.set_result(torch.zeros(3))
    return fut


def _bad_hook(rank: int, world_size: int, which: str) -> None:
    ddp = gradsync.DistributedDataParallel(nn.Linear(4, 2))
    ddp.register_comm_hook(None, _never_completes if which == "never" else _wrong_shape)
    ddp(torch.randn(2, 4)).sum().backward()


@pytest.mark.timeout(60)
def test_a_hook_future_that_never_completes_fails_within_the_timeout() -> None:
    start = time.monotonic()
    failures = spawn_failures(_bad_hook, args=("never",), timeout=50, pg_timeout=5)
    assert time.monotonic() - start < 30
    for f in failures.values():
        assert f.kind == "CollectiveError" and "did not complete within the process group's timeout (5s)" in f.message


@pytest.mark.timeout(60)
def test_a_hook_returning_the_wrong_shape_is_named() -> None:
    for f in spawn_failures(_bad_hook, args=("shape",), timeout=50, pg_timeout=10).values():
        assert f.kind == "ConfigError" and "holds a tensor of 3 elements" in f.message and "bucket 0" in f.message


def _bad_constructor_arguments(rank: int, world_size: int) -> list[str]:
    out = []
    for make in (
        lambda: gradsync.DistributedDataParallel(nn.Linear(2, 2), device_ids="cuda"),
        lambda: gradsync.DistributedDataParallel(nn.Linear(2, 2), process_group="world"),
        lambda: gradsync.DistributedDataParallel(nn.Linear(2, 2, device="meta")),
    ):
        try:
            make()
            out.append("accepted")
        except (TypeError, ValueError) as exc:
            out.append(f"{type(exc).__name__}: {exc}")
    return out


@pytest.mark.timeout(60)
def test_constructor_arguments_of_the_wrong_kind_are_named() -> None:
    msgs = spawn(_bad_constructor_arguments, timeout=50)[0]
    assert msgs[0].startswith("TypeError") and "device_ids must be a list" in msgs[0]
    assert msgs[1].startswith("TypeError") and "process_group must be a torch.distributed.ProcessGroup" in msgs[1]
    assert msgs[2].startswith("ConfigError") and "meta device" in msgs[2] and "to_empty" in msgs[2]


def test_sampler_and_loader_refuse_wrong_kinds_at_construction() -> None:
    with pytest.raises(ConfigError, match="map-style dataset"):
        gradsync.DistributedSampler("abcdef", num_replicas=2, rank=0)
    with pytest.raises(ConfigError, match="batch_size must be an int"):
        gradsync.DistributedLoader(list(range(8)), batch_size="8", num_replicas=2, rank=0)
    sampler = gradsync.DistributedSampler(list(range(10)), num_replicas=2, rank=0)
    state = sampler.state_dict()
    for bad in (-2, 99):
        with pytest.raises(ConfigError, match=f"samples_consumed={bad} is outside"):
            sampler.load_state_dict({**state, "samples_consumed": bad})


def test_truncated_and_foreign_checkpoints_are_named(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    checkpoint.save(path, step=3)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="looks truncated or damaged"):
        checkpoint.load(path)
    path.write_bytes(b"not a checkpoint at all")
    with pytest.raises(CheckpointError, match="is not a checkpoint"):
        checkpoint.load(path)
    torch.save({"weights": torch.zeros(2)}, path)
    with pytest.raises(CheckpointError, match="not a gradsync checkpoint"):
        checkpoint.load(path)


def test_a_killed_saves_temp_file_is_removed_by_the_next_save(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    stale = tmp_path / ".ckpt.pt.tmp-999999"
    stale.write_bytes(b"x" * 1000)
    checkpoint.save(path, step=1)
    assert not stale.exists() and checkpoint.load(path)["step"] == 1


def _skips_a_backward(rank: int, world_size: int) -> None:
    os.environ["GRADSYNC_DEBUG"] = "1"
    ddp = gradsync.DistributedDataParallel(nn.Linear(4, 1))  # no buffers: nothing else would tell the steps apart
    for step in range(3):
        loss = ddp(torch.randn(2, 4)).sum()
        if rank == 1 and step == 1:
            continue
        loss.backward()


@pytest.mark.timeout(60)
def test_a_skipped_backward_is_caught_by_the_step_numbers() -> None:
    failures = spawn_failures(_skips_a_backward, timeout=50, pg_timeout=10)
    for f in failures.values():
        assert f.kind == "DesyncError"
        assert "rank 0: all-reduce of bucket 0" in f.message and "in synced step 2" in f.message
        assert "rank 1: all-reduce of bucket 0" in f.message and "in synced step 3" in f.message


def _cli(args: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "SLURM_"))}
    return subprocess.run(
        [sys.executable, "-m", "gradsync", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


@pytest.mark.timeout(60)
def test_report_on_a_bad_file_prints_one_line(tmp_path: Path) -> None:
    empty, junk = tmp_path / "empty.json", tmp_path / "junk.json"
    empty.write_text("")
    junk.write_text('{"traceEvents": []}')
    for path, words in (
        (tmp_path / "missing.json", "cannot read"),
        (empty, "is not JSON"),
        (junk, "not a gradsync trace"),
    ):
        proc = _cli(["report", str(path)])
        assert proc.returncode == 2 and words in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.timeout(60)
def test_launcher_refuses_a_busy_port_and_zero_workers_at_once() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        start = time.monotonic()
        proc = _cli(["run", "--nproc-per-node", "2", "--master-port", str(port), str(SCRIPTS / "env_dump.py"), "x"])
        assert time.monotonic() - start < 20
    assert proc.returncode == 2 and f"port {port}" in proc.stderr and "--master-port" in proc.stderr
    for bad in ("0", "-1"):
        proc = _cli(["run", "--nproc-per-node", bad, str(SCRIPTS / "env_dump.py"), "x"])
        assert proc.returncode == 2 and "at least 1 worker" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.timeout(120)
def test_watchdog_stops_a_hung_job_with_the_stacks() -> None:
    start = time.monotonic()
    proc = _cli(["run", "--watchdog", "4", "--nproc-per-node", "2", str(SCRIPTS / "hang_after_two_steps.py")], 100)
    assert time.monotonic() - start < 60
    assert proc.returncode != 0
    assert "no rank completed a step for" in proc.stderr
    assert "hang_after_two_steps.py" in proc.stderr and "line 16" in proc.stderr  # rank 1's stack: the sleep loop


def test_error_classes_are_importable_from_one_place() -> None:
    for cls in (CheckpointError, CollectiveError, ConfigError, DesyncError, ModelMismatchError):
        assert issubclass(cls, gradsync.GradsyncError)


def _settings_on_rank0(rank: int, world_size: int, setting: str) -> None:
    kwargs: dict = {}
    if rank == 0 and setting == "GRADSYNC_DEBUG":
        os.environ["GRADSYNC_DEBUG"] = "1"
    elif rank == 0:
        kwargs[setting] = {"bucket_cap_mb": 0.0001, "forward_sync_buffers": False}.get(setting, True)
    gradsync.DistributedDataParallel(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)), **kwargs)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("setting", ["bucket_cap_mb", "static_graph", "forward_sync_buffers", "GRADSYNC_DEBUG"])
def test_a_setting_on_one_rank_only_is_named_at_construction(setting: str) -> None:
    # Different settings issue different collectives, which gloo answers by aborting a process (SIGABRT).
    failures = spawn_failures(_settings_on_rank0, world_size=2, args=(setting,), timeout=60)
    assert sorted(failures) == [0, 1]
    assert all(f.kind == "ModelMismatchError" and setting in f.message for f in failures.values())


def _unfreeze_after_wrapping(rank: int, world_size: int) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    model[0].requires_grad_(False)
    ddp = gradsync.DistributedDataParallel(model)
    ddp(torch.randn(2, 4)).sum().backward()
    model[0].requires_grad_(True)
    ddp(torch.randn(2, 4)).sum().backward()


@pytest.mark.timeout(120)
def test_a_parameter_unfrozen_after_wrapping_is_refused() -> None:
    # torch's DDP leaves its gradients local: the replicas drift apart with no error.
    failures = spawn_failures(_unfreeze_after_wrapping, world_size=2, timeout=60)
    assert all(f.kind == "ConfigError" and "'0.weight'" in f.message for f in failures.values())
    assert sorted(failures) == [0, 1]
