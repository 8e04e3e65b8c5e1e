"""Run each selected test in its own process group, with a hard timeout, and classify the outcome."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from conformance.torch_suite.cpu_mapping import DDP_ENV

START_METHOD_ENV = "GRADSYNC_TORCH_SUITE_START"  # read by conformance.torch_suite.harness

REPO_ROOT = Path(__file__).resolve().parents[2]
TAIL_LINES = 20
SKIP_LINE = re.compile(r"skipping test \S+ for following reason: (.*)")
PROCESS_ERROR = re.compile(r"Process \d+ exited with error code \d+ and exception:\n")
HARNESS_TIMEOUT = "Timing out after"


@dataclass
class Outcome:
    status: str  # passed | failed | skipped | timeout
    seconds: float
    summary: str = ""  # one line: the skip reason or the exception line
    tail: str = ""  # the last lines of the error
    log: str = ""
    ran_at: str = ""
    start_method: str = ""

    def to_json(self) -> dict[str, object]:
        return asdict(self)


def test_env(kind: str, temp_dir: str, timeout_s: float, start_method: str) -> dict[str, str]:
    """The environment of one test process: torch's spawn runner's variables plus the DDP kind."""
    env = dict(os.environ)
    env.update(
        {
            "BACKEND": "gloo",
            "WORLD_SIZE": "2",
            "TEMP_DIR": temp_dir,
            DDP_ENV: kind,
            START_METHOD_ENV: start_method,
            # the harness's own timeout fires first and dumps the hung ranks' stacks; the runner's kill is the backstop
            "DISTRIBUTED_TESTS_DEFAULT_TIMEOUT": str(max(10, int(timeout_s) - 20)),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH", "")])),
            "PYTHONUNBUFFERED": "1",
            "PYTORCH_PRINT_REPRO_ON_FAILURE": "0",
            "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),
        }
    )
    return env


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the group this runner created for the test: its ranks die with it
    except ProcessLookupError:
        pass
    proc.wait()


def run_test(name: str, kind: str, timeout_s: float, log_dir: Path, start_method: str = "spawn") -> Outcome:
    """One test with one DDP kind, in a fresh session; a hang past ``timeout_s`` is a timeout, never a wait."""
    log_path = log_dir / kind / f"{name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    ran_at = time.strftime("%Y-%m-%dT%H:%M:%S")
    with tempfile.TemporaryDirectory(prefix="torch_suite_") as temp_dir, open(log_path, "wb") as log:
        result_path = Path(temp_dir) / "outcome.json"
        cmd = [sys.executable, "-m", "conformance.torch_suite.run_one", name, str(result_path)]
        proc = subprocess.Popen(
            cmd,
            cwd=REPO_ROOT,
            env=test_env(kind, temp_dir, timeout_s, start_method),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        timed_out = _wait(proc, timeout_s)
        raw = json.loads(result_path.read_text()) if result_path.exists() else None
    outcome = classify(raw, timed_out, proc.returncode, log_path.read_text(errors="replace"))
    outcome.seconds = round(time.monotonic() - started, 1)
    outcome.log, outcome.ran_at, outcome.start_method = str(log_path), ran_at, start_method
    return outcome


def _wait(proc: subprocess.Popen[bytes], timeout_s: float) -> bool:
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        return True
    _kill_group(proc)  # ranks left behind by a test that returned anyway
    return False


def classify(raw: dict[str, str] | None, timed_out: bool, returncode: int | None, log: str) -> Outcome:
    if timed_out:
        return Outcome("timeout", 0.0, "killed by the runner's hard timeout", tail(log))
    if raw is None:
        return Outcome("failed", 0.0, f"test process exited with {returncode} and no outcome", tail(log))
    status, message = raw["status"], raw["message"]
    if status == "skipped":
        return Outcome("skipped", 0.0, skip_reason(message, log))
    if status == "failed" and HARNESS_TIMEOUT in log:
        return Outcome("timeout", 0.0, "harness timeout (ranks hung); stacks in the log", tail(log))
    if status == "failed":
        error = first_rank_error(message)
        return Outcome("failed", 0.0, summary_line(error), tail(error))
    return Outcome(status, 0.0)


def skip_reason(message: str, log: str) -> str:
    """The rank's own reason when it logged one (generic exit code 86), else the harness's message."""
    reasons = SKIP_LINE.findall(log)
    return reasons[0].strip() if reasons else message.strip()


def first_rank_error(message: str) -> str:
    """The first failing rank's traceback when the error came from a rank, else the whole message."""
    parts = PROCESS_ERROR.split(message)
    return parts[1] if len(parts) > 1 else message


def tail(text: str, lines: int = TAIL_LINES) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def summary_line(error: str) -> str:
    """The exception line: the first unindented line after the frames of the last traceback."""
    lines = [line for line in error.rstrip().splitlines() if line.strip()]
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")]
    for line in lines[starts[-1] + 1 :] if starts else []:
        if not line[0].isspace():
            return line[:300]
    return lines[-1][:300] if lines else ""
