"""Elastic training survives a lost worker without restarting the job: in a lab of 3 hosts (network namespaces) x 1
rank, a worker killed with SIGKILL, stopped with SIGSTOP, or cut off by taking its host's link down; the survivors
keep their processes and carry on within seconds, every sample of every epoch is used exactly once, and the
restarted worker rejoins so that all three hosts end with identical parameters."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from gradsync.elastic import ElasticLoader

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench import netlab  # noqa: E402

SAMPLES, EPOCHS, HOSTS = 480, 3, 3


def test_loader_hands_out_every_sample_once_across_world_changes() -> None:
    loader = ElasticLoader(list(range(SAMPLES)), batch_size=4, seed=3)
    seen, position = [], 0
    for world in (3, 3, 2, 2, 3, 1) * 40:  # the membership changes between steps
        if position >= SAMPLES:
            break
        shares = [loader.share(position, world, rank) for rank in range(world)]
        seen += [i for indices, _ in shares for i in indices]
        position += shares[0][1]
    assert sorted(seen) == list(range(SAMPLES))


def _launch(lab: list, out: Path, env_extra: dict[str, str]) -> list[subprocess.Popen]:
    procs = []
    for host in lab:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "LOCAL_"))}
        env.update(GLOO_SOCKET_IFNAME=host.interface, GRADSYNC_HOST=f"h{host.index}", PYTHONPATH=str(ROOT))
        env.update(OMP_NUM_THREADS="1", **env_extra)
        argv = [sys.executable, "-m", "gradsync", "run", "--elastic", "--nnodes", str(HOSTS), "--nproc-per-node", "1"]
        argv += ["--max-restarts", "8", "--rdzv-endpoint", f"{lab[0].address}:29650", "--local-addr", host.address]
        argv += [str(ROOT / "tests" / "scripts" / "elastic_train.py"), str(out)]
        command = host.command(["env", *[f"{k}={v}" for k, v in env.items()], *argv])
        procs.append(
            subprocess.Popen(
                command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
            )
        )
    return procs


def _events(out: Path) -> list[dict]:
    found = []
    for path in out.glob("*.events"):
        pid = int(path.stem)
        found += [json.loads(line) | {"pid": pid} for line in path.read_text().splitlines() if line]
    return found


def _pid_of(out: Path, host: str) -> int:
    pids = [int(p.stem) for p in out.glob("*.pid") if p.read_text() == host]
    return max(pids, key=lambda pid: (out / f"{pid}.pid").stat().st_mtime)


def _wait_steps(out: Path, steps: int, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while max((e["step"] for e in _events(out)), default=0) < steps:
        assert time.monotonic() < deadline, f"fewer than {steps} steps within {timeout}s"
        time.sleep(0.1)


def _finish(procs: list[subprocess.Popen], timeout: float = 240) -> list[str]:
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            p.kill()
            logs.append(p.communicate()[0])
    assert all(p.returncode == 0 for p in procs), "\n----\n".join(log[-3000:] for log in logs)
    return logs


def _check_exactly_once(out: Path, epochs: int = EPOCHS) -> None:
    for epoch in range(epochs):
        counts = Counter(i for e in _events(out) if e["epoch"] == epoch for i in e["indices"])
        assert sorted(counts) == list(range(SAMPLES)) and set(counts.values()) == {1}, f"epoch {epoch}"


def _finals(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in out.glob("*.final")]


def _first_step_after(out: Path, when: float, pids: list[int]) -> float:
    return min(e["t"] for e in _events(out) if e["t"] > when and e["pid"] in pids) - when


needs_lab = pytest.mark.skipif(netlab.available() is not None, reason=f"network namespaces: {netlab.available()}")


def _scenario(tmp_path: Path, fault: str, count: int = 1, epochs: int = EPOCHS) -> dict:
    out = tmp_path / fault
    out.mkdir()
    with netlab.lab(hosts=HOSTS, rate="1gbit", prefix="gselastic") as lab:
        procs = _launch(lab, out, {"STEP_SLEEP": "0.05", "ELASTIC_TIMEOUT": "5", "EPOCHS": str(epochs)})
        try:
            return _inject_and_finish(lab, procs, out, fault, count)
        finally:
            # A failed test leaves no launcher or worker behind (the workers run in sessions of their own).
            for pid in [p.pid for p in procs] + [int(f.stem) for f in out.glob("*.pid")]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def _inject_and_finish(lab: list, procs: list[subprocess.Popen], out: Path, fault: str, count: int) -> dict:
    _wait_steps(out, 15)
    survivors = [_pid_of(out, "h0"), _pid_of(out, "h2")]
    faults, when = [], 0.0
    for k in range(count):
        victim = "h2" if fault == "sigkill" and k % 2 else "h1"
        pid = _training_pid(out, victim, since=when)  # a restarted victim has rejoined and committed a step
        when = time.time()
        faults.append((victim, pid, when))
        _inject(fault, lab[int(victim[1])], pid)
        _wait_after(out, when, [_pid_of(out, h) for h in ("h0", "h1", "h2") if h != victim])
    logs = _finish(procs)
    return {"out": out, "survivors": survivors, "faults": faults, "logs": logs}


def _training_pid(out: Path, host: str, since: float, timeout: float = 60) -> int:
    deadline = time.monotonic() + timeout
    while not any(e["pid"] == _pid_of(out, host) and e["t"] > since for e in _events(out)):
        assert time.monotonic() < deadline, f"the worker on {host} made no step within {timeout}s"
        time.sleep(0.1)
    return _pid_of(out, host)


def _inject(fault: str, host, pid: int) -> None:
    if fault == "sigkill":
        os.kill(pid, signal.SIGKILL)
    elif fault == "sigstop":
        os.kill(pid, signal.SIGSTOP)
        time.sleep(8)
        os.kill(pid, signal.SIGCONT)
    elif fault == "link":
        subprocess.run(["ip", "-n", host.namespace, "link", "set", host.interface, "down"], check=True)
        time.sleep(8)
        subprocess.run(["ip", "-n", host.namespace, "link", "set", host.interface, "up"], check=True)


def _wait_after(out: Path, when: float, pids: list[int], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not any(e["t"] > when and e["pid"] in pids for e in _events(out)):
        assert time.monotonic() < deadline, "the survivors made no step after the fault"
        time.sleep(0.05)


@needs_lab
@pytest.mark.timeout(420)
def test_survivors_continue_after_sigkill_and_the_worker_rejoins(tmp_path: Path) -> None:
    reference = _scenario(tmp_path, "none", count=0)
    run = _scenario(tmp_path, "sigkill")
    out, (_victim, _pid, when) = run["out"], run["faults"][0]
    assert [_pid_of(out, "h0"), _pid_of(out, "h2")] == run["survivors"]  # unchanged processes
    assert _first_step_after(out, when, run["survivors"]) < 3.0
    _check_exactly_once(out)
    finals = _finals(out)
    assert len({round(f["checksum"], 6) for f in finals if f["steps"] == max(g["steps"] for g in finals)}) == 1
    ref_loss = _finals(reference["out"])[0]["loss"]
    assert all(abs(f["loss"] - ref_loss) <= 0.15 * ref_loss + 0.01 for f in finals)


@needs_lab
@pytest.mark.lab
@pytest.mark.timeout(420)
@pytest.mark.parametrize("fault", ["link", "sigstop"])
def test_survivors_continue_when_a_worker_goes_silent(tmp_path: Path, fault: str) -> None:
    run = _scenario(tmp_path, fault)
    out, (_victim, _pid, when) = run["out"], run["faults"][0]
    assert _first_step_after(out, when, run["survivors"]) < 5.0 + 3.0  # heartbeat timeout + 3 s
    _check_exactly_once(out)


@needs_lab
@pytest.mark.lab
@pytest.mark.timeout(600)
def test_five_failures_in_one_run(tmp_path: Path) -> None:
    run = _scenario(tmp_path, "sigkill", count=5, epochs=10)
    _check_exactly_once(run["out"], epochs=10)
    assert len(_finals(run["out"])) == HOSTS
