"""`gradsync run`: torchrun's environment, failures reported with their cause, and restarts that work."""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from gradsync.runtime.env import discover, expand_slurm_nodelist
from gradsync.store.etcd_refusal import EtcdRefused
from gradsync.testing import free_port

SCRIPTS = Path(__file__).parent / "scripts"


def _run(args: list[str], timeout: float = 90) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "SLURM_"))}
    return subprocess.run(
        [sys.executable, "-m", "gradsync", "run", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


@pytest.mark.long
@pytest.mark.timeout(120)
def test_workers_get_torchrun_environment(tmp_path: Path) -> None:
    proc = _run(["--nproc-per-node", "2", "--standalone", str(SCRIPTS / "env_dump.py"), str(tmp_path)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r, rec in enumerate(records):
        assert rec["RANK"] == rec["LOCAL_RANK"] == str(r) and rec["info_rank"] == r
        assert rec["WORLD_SIZE"] == rec["LOCAL_WORLD_SIZE"] == "2"
        assert rec["MASTER_ADDR"] and rec["MASTER_PORT"] and rec["TORCHELASTIC_RESTART_COUNT"] == "0"
        assert rec["sum"] == 2.0


@pytest.mark.timeout(120)
def test_failure_names_rank_exit_code_and_stderr() -> None:
    proc = _run(["--nproc-per-node", "2", "--standalone", str(SCRIPTS / "fail_once.py")])
    assert proc.returncode == 7
    assert "rank 1 (local rank 1" in proc.stderr and "exit code 7" in proc.stderr
    assert "fail_once: rank 1 crashing on purpose" in proc.stderr.split("gradsync run: rank ")[-1]


@pytest.mark.long
@pytest.mark.timeout(300)
def test_restart_after_failure_works_every_time() -> None:
    """torchrun restarted this cleanly 1–2 times in 4 on torch 2.13 (stale keys in a shared store)."""
    for attempt in range(5):
        proc = _run(["--nproc-per-node", "2", "--max-restarts", "1", "--standalone", str(SCRIPTS / "fail_once.py")])
        assert proc.returncode == 0, f"run {attempt}: {proc.stderr[-3000:]}"
        assert "attempt 1 rank 0 done" in proc.stdout and "attempt 1 rank 1 done" in proc.stdout


def test_the_launcher_imports_no_training_machinery() -> None:
    """``gradsync run`` starts its workers without first importing what only a worker uses: gradsync's DDP and
    elastic training, torch.compile's dynamo and DTensor (seconds of CPU before any worker starts; gradsync.exports).
    A plain ``import gradsync`` imports none of it either."""
    heavy = ("gradsync.ddp", "gradsync.elastic.state", "gradsync.checkpoint", "torch._dynamo")
    heavy += ("torch.distributed.tensor",)
    probe = "import sys, gradsync, gradsync.cli, gradsync.launch.run\n"
    probe += f"print([m for m in {heavy!r} if m in sys.modules])"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr


def test_slurm_variables_map_to_torchrun_ones() -> None:
    env = {
        "SLURM_PROCID": "5",
        "SLURM_NTASKS": "8",
        "SLURM_LOCALID": "1",
        "SLURM_NTASKS_PER_NODE": "4(x2)",
        "SLURM_JOB_NODELIST": "gpu[07-08]",
        "SLURM_JOB_ID": "123",
    }
    found = discover(env)
    assert found == {
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "gpu07",
        "MASTER_PORT": str(15000 + 123),
    }
    assert discover({"RANK": "1", "WORLD_SIZE": "2", "SLURM_PROCID": "9", "SLURM_NTASKS": "9"})["RANK"] == "1"
    assert expand_slurm_nodelist("a[1-3,10],b,c[08-09]") == ["a1", "a2", "a3", "a10", "b", "c08", "c09"]


@pytest.mark.timeout(120)
def test_single_process_without_launcher(tmp_path: Path) -> None:
    code = (
        "import torch, gradsync\n"
        "info = gradsync.init()\n"
        "assert (info.rank, info.world_size, info.device.type) == (0, 1, 'cpu'), info\n"
        "m = gradsync.DistributedDataParallel(torch.nn.Linear(2, 1))\n"
        "m(torch.ones(3, 2)).sum().backward()\n"
        "assert torch.equal(m.module.bias.grad, torch.tensor([3.0]))\n"
        "print('single ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "SLURM_"))}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0 and "single ok" in proc.stdout, proc.stderr


def _pet_env(**pet: str) -> dict[str, str]:
    """A pod's environment as Kubeflow's training operator leaves it: PET_* for torchrun's flags."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "PET_"))}
    return env | {f"PET_{k}": v for k, v in pet.items()}


_ENV_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_WORLD_SIZE")


@pytest.mark.long
@pytest.mark.timeout(180)
def test_gradsync_run_takes_its_configuration_from_pet_variables_as_torchrun_does(tmp_path: Path) -> None:
    """No flags: nodes, workers per node, node rank, master and restarts from PET_* (torchrun's `env` action, which
    Kubeflow's PyTorchJob and TorchX rely on). Both launchers give their workers the same ranks and sizes."""
    seen = {}
    for launcher in ("torchrun", "gradsync"):
        out = tmp_path / launcher
        out.mkdir()
        pet = dict(NNODES="1", NPROC_PER_NODE="2", NODE_RANK="0", MASTER_ADDR="127.0.0.1", MAX_RESTARTS="0")
        env = _pet_env(**pet, MASTER_PORT=str(free_port()))
        module = ["torch.distributed.run"] if launcher == "torchrun" else ["gradsync", "run"]
        argv = [sys.executable, "-m", *module, str(SCRIPTS / "env_dump.py"), str(out)]
        done = subprocess.run(argv, env=env, capture_output=True, timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        records = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
        seen[launcher] = [{k: rec.get(k) for k in _ENV_KEYS} for rec in records]
    assert seen["gradsync"] == seen["torchrun"] and seen["gradsync"][1]["WORLD_SIZE"] == "2", seen


def _manifest(name: str) -> dict:
    yaml = pytest.importorskip("yaml")
    return yaml.safe_load((Path(__file__).parents[1] / "examples" / "kubernetes" / name).read_text())


@pytest.mark.long
@pytest.mark.timeout(180)
def test_the_static_pytorchjobs_command_runs_with_the_variables_the_operator_sets(tmp_path: Path) -> None:
    """examples/kubernetes/pytorchjob.yaml's command, as written, in one "pod" with the PET_* variables the
    operator sets for it (here a one-pod job, so that it runs on this machine)."""
    job = _manifest("pytorchjob.yaml")
    command = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["command"]
    assert command[:2] == ["gradsync", "run"]
    (tmp_path / "examples").symlink_to(Path(__file__).parents[1] / "examples")  # the image's working directory
    pet = dict(NNODES="1", NPROC_PER_NODE=job["spec"]["nprocPerNode"], NODE_RANK="0", MASTER_ADDR="127.0.0.1")
    env = _pet_env(**pet, MASTER_PORT=str(free_port()))
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    done = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=150)
    assert done.returncode == 0 and "FINAL_ACCURACY" in done.stdout, done.stderr[-3000:]
    assert "2 rank(s)" in done.stdout


def test_the_elastic_pytorchjobs_command_reads_the_operators_elastic_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    """examples/kubernetes/pytorchjob-elastic.yaml: with its elasticPolicy the operator sets PET_NNODES to
    min:max, PET_RDZV_ID to the job's name (the job's keys in etcd), PET_MAX_RESTARTS and the rendezvous."""
    from gradsync.launch.run import _parser

    job = _manifest("pytorchjob-elastic.yaml")
    policy = job["spec"]["elasticPolicy"]
    command = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["command"]
    pet = {
        "NNODES": f"{policy['minReplicas']}:{policy['maxReplicas']}",
        "NPROC_PER_NODE": job["spec"]["nprocPerNode"],
        "RDZV_BACKEND": policy["rdzvBackend"],
        "RDZV_ENDPOINT": "gradsync-elastic-worker-0:29400",
        "RDZV_ID": job["metadata"]["name"],
        "MAX_RESTARTS": str(policy["maxRestarts"]),
    }
    for key, value in pet.items():
        monkeypatch.setenv(f"PET_{key}", value)
    args = _parser().parse_args(command[2:])
    assert args.elastic and args.store.startswith("etcd://") and args.rdzv_id == "gradsync-elastic"
    assert (args.nnodes, args.nproc_per_node, args.max_restarts) == ("2:3", "1", 5)
    assert args.training_script == "train.py"


# ------------------------------------------------------------------------------ the CLI's contract
def _one_refusal(capsys: pytest.CaptureFixture[str], command: str = "run") -> str:
    said = capsys.readouterr().err.splitlines()
    assert len(said) == 1 and said[0].startswith(f"gradsync {command}: "), said
    return said[0]


NOT_A_DURATION = ["nan", "inf", "-inf", "0", "-1", "1e400", "abc", ""]


@pytest.mark.parametrize("value", NOT_A_DURATION)
def test_every_float_flag_refuses_what_is_not_a_duration(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Generated from the parser: each float flag (torchrun's and gradsync's) is parsed as seconds, > 0 and finite,
    by gradsync run and gradsync doctor alike (--watchdog nan would be a watchdog that never fires)."""
    from torch.distributed.run import get_args_parser

    from gradsync import cli
    from gradsync.runtime import run_flags

    checked = {a.dest for a in run_flags.parser()._actions if isinstance(a.type, run_flags.Seconds)}
    assert checked >= {a.dest for a in get_args_parser()._actions if a.type is float} | {"watchdog"}, checked
    for dest in sorted(checked):
        flag = run_flags.flag_name(dest)
        for command in ("run", "doctor"):
            assert cli.main([command, f"{flag}={value}", "train.py"]) == 2
            said = _one_refusal(capsys, command)
            assert flag in said and "finite number of seconds > 0" in said, said


def test_a_refusal_is_one_line_and_its_traceback_is_shown_when_asked(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from gradsync import cli

    monkeypatch.delenv("GRADSYNC_DEBUG", raising=False)
    bad = ["--watchdog", "nan", "train.py"]
    for argv in (["run", *bad], ["run", *bad, "-v"]):  # a -v after the script is the script's
        assert cli.main(argv) == 2
        _one_refusal(capsys)
    for argv in (["-v", "run", *bad], ["run", "--verbose", *bad], ["doctor", "-v", *bad]):
        assert cli.main(argv) == 2
        assert "Traceback (most recent call last)" in capsys.readouterr().err, argv
    monkeypatch.setenv("GRADSYNC_DEBUG", "1")
    assert cli.main(["run", *bad]) == 2
    assert "Traceback (most recent call last)" in capsys.readouterr().err


@pytest.mark.parametrize(
    "error",
    [
        ssl.SSLError(1, "[SSL] PEM lib (_ssl.c:3905)"),
        IsADirectoryError(21, "Is a directory"),
        EtcdRefused("no"),
        dist.DistStoreError("timed out"),
    ],
)
def test_what_a_server_or_the_system_refuses_is_one_line_and_exit_2(
    error: Exception, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Raised past the flags' checks (a member refusing this client, OpenSSL, a file): still the CLI's rule."""
    from gradsync import cli
    from gradsync.doctor import report
    from gradsync.launch import run

    def refuse(argv: object) -> int:
        raise error

    monkeypatch.delenv("GRADSYNC_DEBUG", raising=False)
    monkeypatch.setattr(run, "main", refuse)
    monkeypatch.setattr(report, "main", refuse)
    for command in ("run", "doctor"):
        assert cli.main([command, "train.py"]) == 2
        said = _one_refusal(capsys, command)
        assert str(getattr(error, "message", error)) in said and "Traceback" not in said


def test_a_timeout_too_long_for_torch_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """GRADSYNC_TIMEOUT=99999999999999 was an OverflowError (days=1157407407) out of datetime.timedelta."""
    import gradsync
    from gradsync.errors import ConfigError

    monkeypatch.setenv("GRADSYNC_TIMEOUT", "99999999999999")
    with pytest.raises(ConfigError, match="GRADSYNC_TIMEOUT='99999999999999'.*at most"):
        gradsync.init()
    monkeypatch.delenv("GRADSYNC_TIMEOUT")
    with pytest.raises(ConfigError, match=r"init\(timeout=100000000000000.0\).*at most 1e\+09"):
        gradsync.init(timeout=1e14)


def test_plain_init_under_the_elastic_launcher_names_the_elastic_api() -> None:
    """gradsync run --elastic sets WORLD_SIZE and its store, not RANK: "RANK is not set" pointed the wrong way."""
    from gradsync.errors import ConfigError

    with pytest.raises(ConfigError, match=r"gradsync.elastic.init\(\) in place of gradsync.init\(\)"):
        discover({"GRADSYNC_ELASTIC_STORE": "127.0.0.1:29400", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})
    with pytest.raises(ConfigError, match="WORLD_SIZE is set but RANK is not"):
        discover({"WORLD_SIZE": "2"})


@pytest.mark.timeout(180)
def test_the_elastic_launcher_gives_up_at_once_when_every_worker_failed_alike(tmp_path: Path) -> None:
    """Every worker failed with the same error: no member will finish, so the launcher does not wait for them
    (it sat 60 s), and it says the error once."""
    script = tmp_path / "plain.py"
    script.write_text("import gradsync\ngradsync.init()\n")
    began = time.monotonic()
    proc = _run(["--elastic", "--nproc-per-node", "2", str(script)], timeout=170)
    took = time.monotonic() - began
    assert proc.returncode == 1, proc.stderr[-3000:]
    said = [line for line in proc.stderr.splitlines() if "every worker here failed with the same error" in line]
    assert len(said) == 1 and "gradsync.elastic.init()" in said[0], proc.stderr[-3000:]
    print(f"gave up after {took:.1f} s")


def test_the_elastic_launcher_tells_one_error_from_several(tmp_path: Path) -> None:
    from gradsync.launch.elastic import Worker, _one_error

    workers = [Worker(r, "h", exit_codes=[1]) for r in range(2)]
    for w, error in zip(workers, ("ValueError: same", "ValueError: same"), strict=True):
        folder = tmp_path / f"worker{w.local_rank}-0" / "run" / "attempt_0" / "0"
        folder.mkdir(parents=True)
        (folder / "stderr.log").write_text(f"Traceback (most recent call last):\n  x\n{error}\n")
    assert _one_error(workers, str(tmp_path)) == "ValueError: same"
    (tmp_path / "worker1-0" / "run" / "attempt_0" / "0" / "stderr.log").write_text("KeyError: 'other'\n")
    assert _one_error(workers, str(tmp_path)) is None
    workers[1].exit_codes = [0]
    assert _one_error(workers, str(tmp_path)) is None
