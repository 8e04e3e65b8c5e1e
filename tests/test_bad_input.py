"""Bad input and faults: nothing silently wrong, nothing hangs, every error names what is wrong and what to do
(one case per finding of the adversarial sweep in conformance/sweep/)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import gradsync
from gradsync import checkpoint
from gradsync.errors import CheckpointError, CollectiveError, ConfigError, DesyncError, ModelMismatchError
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
    start = time.monotonic()
    if rank == 0:
        checkpoint.save(path, step=1)
    else:
        time.sleep(8)  # rank 1 never calls save
    return time.monotonic() - start


@pytest.mark.timeout(60)
def test_saving_on_rank0_only_says_every_rank_must_call_save(tmp_path: Path) -> None:
    # The wait follows the process group's timeout (3 s here), not a fixed minute.
    failures = spawn_failures(_save_on_rank0_only, args=(str(tmp_path / "c.pt"),), timeout=50, pg_timeout=3)
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


def test_report_on_a_bad_file_prints_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """In this process (a command's refusal is main()'s return value and its one line of stderr; the launcher's
    tests below run the command as a process)."""
    empty, junk = tmp_path / "empty.json", tmp_path / "junk.json"
    empty.write_text("")
    junk.write_text('{"traceEvents": []}')
    for path, words in (
        (tmp_path / "missing.json", "cannot read"),
        (empty, "is not JSON"),
        (junk, "not a gradsync trace"),
    ):
        said = _cli_here(capsys, "report", str(path))
        assert words in said and "Traceback" not in said, said


@pytest.mark.long
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


@pytest.mark.long
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


# ------------------------------------------------------------------ the sweep's "vague" findings, made clear
def test_checkpoint_load_blames_map_location_not_the_file(tmp_path: Path) -> None:
    checkpoint.save(tmp_path / "ok.pt", step=1)
    with pytest.raises(ConfigError, match="map_location='gpu0'") as info:
        checkpoint.load(tmp_path / "ok.pt", map_location="gpu0")
    assert "truncated" not in str(info.value) and "damaged" not in str(info.value)


def test_checkpoint_save_names_the_value_that_cannot_be_pickled(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="my_callback") as info:
        checkpoint.save(tmp_path / "ckpt.pt", step=1, my_callback=lambda: 0)
    assert "cannot be pickled" in str(info.value)
    assert not list(tmp_path.iterdir())  # no temporary file left


def test_checkpoint_save_unwritable_path_is_not_called_a_full_disk() -> None:
    with pytest.raises(CheckpointError, match="cannot write '/proc/ckpt.pt'") as info:
        checkpoint.save("/proc/ckpt.pt", step=1)
    assert "no space" not in str(info.value)


def test_checkpoint_restore_of_a_path_says_to_load_it_first(tmp_path: Path) -> None:
    checkpoint.save(tmp_path / "ok.pt", step=1)
    with pytest.raises(ConfigError, match=r"checkpoint\.load\(path\)"):
        checkpoint.restore(str(tmp_path / "ok.pt"), model=nn.Linear(2, 2))


def test_sampler_and_loader_name_an_epoch_or_state_of_the_wrong_kind() -> None:
    sampler = gradsync.DistributedSampler(list(range(10)), num_replicas=2, rank=0)
    with pytest.raises(ConfigError, match="set_epoch: epoch must be an int"):
        sampler.set_epoch("1")
    with pytest.raises(ConfigError, match=r"DistributedSampler\.load_state_dict: expected the dict"):
        sampler.load_state_dict("ckpt.pt")
    loader = gradsync.DistributedLoader(list(range(8)), batch_size=2, num_replicas=2, rank=0)
    with pytest.raises(ConfigError, match=r"DistributedLoader\.load_state_dict: expected the dict"):
        loader.load_state_dict("ckpt.pt")
    with pytest.raises(ConfigError, match="epoch must be an int"):
        loader.set_epoch(1.5)


def _init_with(monkeypatch: pytest.MonkeyPatch, **env: str) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    gradsync.init(timeout=2)


@pytest.mark.parametrize("port", ["abc", "99999"])
def test_bad_master_port_is_named(monkeypatch: pytest.MonkeyPatch, port: str) -> None:
    with pytest.raises(ConfigError, match=f"MASTER_PORT='{port}' is not a TCP port"):
        _init_with(monkeypatch, RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)


def test_unresolvable_master_addr_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="MASTER_ADDR='no-such-host.invalid' cannot be resolved"):
        _init_with(monkeypatch, RANK="0", WORLD_SIZE="1", MASTER_ADDR="no-such-host.invalid", MASTER_PORT="29555")


@pytest.mark.timeout(30)
def test_a_rank_that_never_starts_is_counted_against_world_size(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    with pytest.raises(CollectiveError, match=r"only 1 of 2 ranks \(WORLD_SIZE=2\) joined") as info:
        _init_with(monkeypatch, RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    assert "1 never arrived" in str(info.value)


def test_init_names_a_bad_timeout_and_backend() -> None:
    with pytest.raises(ConfigError, match=r"init\(timeout=-1\): the timeout must be > 0"):
        gradsync.init(timeout=-1)
    with pytest.raises(ConfigError, match=r"init\(backend='glooo'\): unknown backend; use one of \['gloo'"):
        gradsync.init(backend="glooo")


def test_slurm_variables_are_named_as_slurm_sets_them() -> None:
    with pytest.raises(ConfigError, match="SLURM_PROCID='abc' is not an integer"):
        discover({"SLURM_PROCID": "abc", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "localhost"})
    with pytest.raises(ConfigError, match=r"SLURM_JOB_NODELIST='gpu\[a-b\]' is not a SLURM node list"):
        discover({"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_NODELIST": "gpu[a-b]"})


def test_local_sgd_and_diloco_name_arguments_of_the_wrong_kind(group_of_one: None) -> None:
    from gradsync.comm import DiLoCo, PostLocalSGD

    with pytest.raises(ConfigError, match="PostLocalSGD attaches to a gradsync.DistributedDataParallel"):
        PostLocalSGD(nn.Linear(2, 2), period=4)
    ddp = gradsync.DistributedDataParallel(nn.Linear(2, 2))
    with pytest.raises(ConfigError, match=r"PostLocalSGD: period .* must be an int >= 1, got str '4'"):
        PostLocalSGD(ddp, period="4")
    with pytest.raises(ConfigError, match=r"DiLoCo: period .* must be an int >= 1, got float 2.0"):
        DiLoCo(ddp, period=2.0)
    with pytest.raises(ConfigError, match="DiLoCo: outer_lr must be a number >= 0, got str '0.7'"):
        DiLoCo(ddp, period=2, outer_lr="0.7")


def _cli_here(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """``gradsync ARGS`` in this process (the checks run before anything starts): its one line of stderr."""
    from gradsync.cli import main

    assert main(list(args)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize(
    "flags,words",
    [
        (["--nproc-per-node", "abc"], "--nproc-per-node abc: give the number of workers"),
        (["--nnodes", "two"], "--nnodes two: give the number of nodes"),
        (["--nnodes", "3:2"], "with 1 <= MIN <= MAX"),
        (["--max-restarts", "-1"], "--max-restarts -1: give how many times"),
        (["--rdzv-endpoint", "localhost:notaport"], "--rdzv-endpoint localhost:notaport is not HOST:PORT"),
        (["--store", "etcd://127.0.0.1:2379"], "the job's store is elastic's; add --elastic"),
        (["--elastic", "--store", "127.0.0.1:2379"], "give the etcd cluster's members, etcd://HOST:PORT"),
        (["--elastic", "--store", "etcd://127.0.0.1:2379/job"], "the job's name comes from --rdzv-id"),
        (["--elastic", "--store", "etcd://127.0.0.1:x"], "is not HOST:PORT"),
        (["--elastic", "--store", "etcd://127.0.0.1:2379"], "name the job with --rdzv-id NAME"),
    ],
)
def test_run_refuses_bad_flags_in_one_line(capsys: pytest.CaptureFixture[str], flags: list[str], words: str) -> None:
    assert words in _cli_here(capsys, "run", *flags, "train.py")


def _trace(tmp_path: Path, steps: int) -> Path:
    from gradsync.observe.recorder import StepRecord
    from gradsync.observe.trace import write_chrome_trace

    records = [
        StepRecord(1.0 + s, 1.01 + s, 1.011 + s, 1.05 + s, 1.06 + s, 1.07 + s, 1.08 + s, []) for s in range(steps)
    ]
    path = tmp_path / "trace.json"
    write_chrome_trace({0: records, 1: records}, path)
    return path


def test_report_refuses_an_empty_trace_a_missing_step_and_an_unwritable_out(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert "holds no steps" in _cli_here(capsys, "report", str(_trace(tmp_path, 0)))
    trace = _trace(tmp_path, 3)
    assert "--step 99: the trace holds 3 step(s)" in _cli_here(capsys, "report", str(trace), "--step", "99")
    err = _cli_here(capsys, "report", str(trace), "--out", "/proc/nope/plot.png")
    assert "cannot write the plot '/proc/nope/plot.png'" in err


def test_launcher_summary_names_the_first_failed_rank_and_its_error(tmp_path: Path) -> None:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from gradsync.launch.run import failure_report

    for local_rank, lines in (
        (0, ["waiting"]),
        (1, ["[rank1]: Traceback (most recent call last):", "[rank1]: ValueError: boom"]),
    ):
        log = tmp_path / "run" / "attempt_0" / str(local_rank) / "stderr.log"
        log.parent.mkdir(parents=True)
        log.write_text("\n".join(lines) + "\n")
    failures = {1: ProcessFailure(1, 11, 1, "none"), 0: ProcessFailure(0, 10, -15, "none")}
    failures[0].timestamp = failures[1].timestamp + 1
    report = failure_report(ChildFailedError("train.py", failures), str(tmp_path), 0)
    assert report.splitlines()[0].startswith("gradsync run: rank 1 failed first: ValueError: boom (exit code 1)")


def test_wrappers_name_a_model_that_is_not_ddp_and_a_module_that_is_not_one() -> None:
    from gradsync.observe import Monitor
    from gradsync.optim import OverlappedOptimizer

    for make, who in (
        (lambda: Monitor(nn.Linear(2, 2)), "Monitor"),
        (lambda: OverlappedOptimizer(nn.Linear(2, 2), torch.optim.SGD, lr=0.1), "OverlappedOptimizer"),
    ):
        with pytest.raises(ConfigError, match=f"{who} attaches to a gradsync.DistributedDataParallel, got torch"):
            make()
    with pytest.raises(ConfigError, match="convert_sync_batchnorm expects a torch.nn.Module"):
        gradsync.SyncBatchNorm.convert_sync_batchnorm("model")


def test_sharded_optimizer_names_optimizer_class_of_the_wrong_kind() -> None:
    params = list(nn.Linear(2, 2).parameters())
    with pytest.raises(ConfigError, match="optimizer_class must be an optimizer class .* got str 'adam'"):
        gradsync.ShardedOptimizer(params, "adam", lr=0.1)
    with pytest.raises(ConfigError, match="optimizer_class must be an optimizer class, got an instance of SGD"):
        gradsync.ShardedOptimizer(params, torch.optim.SGD(params, lr=0.1), lr=0.1)


def _uneven_under_ddp_join_only(rank: int, world_size: int) -> None:
    ddp = gradsync.DistributedDataParallel(nn.Linear(4, 2))
    opt = gradsync.ShardedOptimizer(ddp.parameters(), torch.optim.SGD, lr=0.1)
    with ddp.join():
        for _ in range(3 if rank == 0 else 2):
            opt.zero_grad()
            ddp(torch.randn(2, 4)).sum().backward()
            opt.step()


@pytest.mark.timeout(60)
def test_sharded_optimizer_left_out_of_join_says_to_join_it_too() -> None:
    failures = spawn_failures(_uneven_under_ddp_join_only, timeout=50, pg_timeout=4)
    assert sorted(failures) == [0, 1]
    for f in failures.values():  # rank 1 ran out of data first: its error comes from torch's Join loop, named
        assert f.kind == "CollectiveError" and "Join([ddp, optimizer])" in f.message
    assert "rank 1 ran out of data" in failures[1].message


def test_elastic_state_and_loader_refuse_what_they_cannot_use_at_the_call() -> None:
    from gradsync import elastic

    with pytest.raises(ConfigError, match=r"elastic.State: job must be what gradsync.elastic.init\(\) returned"):
        elastic.State(None, model=None, optimizer=None, loader=None)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="ElasticLoader: dataset must have a length and be indexable"):
        elastic.ElasticLoader((x for x in range(10)), batch_size=2)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--profile", "{empty}"], "--profile: the list of layers is empty"),
        (["--profile", "{negative}"], r"--profile: layer 0 is \[1000, -0.1, 0.2\]"),
        (["--profile", "{good}", "--hosts", "0", "2"], r"--hosts: every count of hosts must be >= 1, got \[0, 2\]"),
        (["--profile", "{good}", "--ranks-per-host", "-2"], "--ranks-per-host must be >= 1, got -2"),
    ],
)
def test_gradsync_plan_refuses_impossible_topologies_and_profiles(tmp_path: Path, argv: list[str], says: str) -> None:
    from gradsync import planner

    profiles = {"empty": [], "negative": [[1000, -0.1, 0.2]], "good": [[1000, 0.1, 0.2]]}
    for name, layers in profiles.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(layers))
    argv = [a.format(**{k: str(tmp_path / f"{k}.json") for k in profiles}) for a in argv]
    with pytest.raises(ConfigError, match=says):
        planner.main(argv)


def test_quantized_state_quotes_a_wrong_type() -> None:
    from gradsync.comm import QuantizedState

    with pytest.raises(ValueError, match=r"bits must be 8 or 4 \(an int\), got '8'"):
        QuantizedState(None, bits="8")  # type: ignore[arg-type]


def _one_more_buffer_on_rank1(rank: int, world_size: int) -> None:
    model = nn.Linear(3, 3)
    if rank == 1:
        model.register_buffer("b1", torch.zeros(3))
    gradsync.DistributedDataParallel(model)


@pytest.mark.timeout(60)
def test_an_extra_buffer_on_one_rank_is_named_as_the_models_buffers() -> None:
    for f in spawn_failures(_one_more_buffer_on_rank1, timeout=50, pg_timeout=10).values():
        assert "needs the same model on every rank" in f.message and "at buffer #0" in f.message, f.message
        assert "'b1' shape=[3]" in f.message and "rank 0 has nothing there" in f.message


# ------------------------------------------------------------ issue 58: restored states of the comm strategies
def _trained_diloco(width: int, streaming: bool) -> Any:
    from gradsync.comm import DiLoCo, StreamingDiLoCo

    torch.manual_seed(0)
    ddp = gradsync.DistributedDataParallel(nn.Sequential(nn.Linear(4, width), nn.Linear(width, 2)))
    strategy = StreamingDiLoCo(ddp, period=2, fragments=2) if streaming else DiLoCo(ddp, period=2)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        ddp(torch.ones(3, 4)).sum().backward()
        opt.step()
        strategy.step()
    return strategy


@pytest.mark.parametrize("streaming", [False, True], ids=["DiLoCo", "StreamingDiLoCo"])
def test_diloco_refuses_another_models_state_and_keeps_its_own(group_of_one: None, streaming: bool) -> None:
    """Another model's anchors were copied tensor by tensor until a shape mismatch (a bare size error), with the
    step count already overwritten; an empty state was a bare KeyError."""
    name = "StreamingDiLoCo" if streaming else "DiLoCo"
    mine, other = _trained_diloco(8, streaming), _trained_diloco(16, streaming)
    before = mine.state_dict()
    with pytest.raises(ConfigError, match=rf"{name}.load_state_dict: the state's anchors? holds .* another model"):
        mine.load_state_dict(other.state_dict())
    with pytest.raises(ConfigError, match=rf"{name}.load_state_dict: the state has no 'step_count'"):
        mine.load_state_dict({})
    after = mine.state_dict()
    assert after["step_count"] == before["step_count"]
    mine.load_state_dict(before)  # its own state loads


def test_post_local_sgd_refuses_a_state_that_is_no_step_count(group_of_one: None) -> None:
    from gradsync.comm import PostLocalSGD

    local = PostLocalSGD(gradsync.DistributedDataParallel(nn.Linear(2, 2)), period=2)
    with pytest.raises(ConfigError, match="PostLocalSGD.load_state_dict: the state has no 'step_count'"):
        local.load_state_dict({})
    with pytest.raises(ConfigError, match=r"step_count must be an int >= 0, got int -1"):
        local.load_state_dict({"step_count": -1})
