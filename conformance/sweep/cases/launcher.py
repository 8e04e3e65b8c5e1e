"""``gradsync run`` and ``gradsync report`` as a user types them: bad flags, a taken port, missing or broken
files, workers that crash or hang. A user error must be one line on stderr and exit code 2, never a traceback."""

from __future__ import annotations

import json
import socket
import tempfile
from pathlib import Path

from conformance.sweep.core import case, gradsync_cli, refused

CAT = "launcher/CLI"

TRIVIAL = """
import torch, gradsync
info = gradsync.init()
ddp = gradsync.DistributedDataParallel(torch.nn.Linear(2, 1))
ddp(torch.ones(3, 2)).sum().backward()
gradsync.shutdown()
print("trained", info.rank, flush=True)
"""

HANGS = """
import time, torch, gradsync
info = gradsync.init()
ddp = gradsync.DistributedDataParallel(torch.nn.Linear(2, 1))
ddp(torch.ones(3, 2)).sum().backward()

def stuck_forever():
    while True:  # a deadlock, a stalled data loader...
        time.sleep(0.2)

stuck_forever()
"""

RANK1_RAISES = """
import os, torch, gradsync
info = gradsync.init()
if info.rank == 1:
    raise ValueError("boom: bad shard on rank 1")
gradsync.DistributedDataParallel(torch.nn.Linear(2, 1))
"""

RANK1_SEGFAULT = """
import os, signal, torch, gradsync
info = gradsync.init()
if info.rank == 1:
    os.kill(os.getpid(), signal.SIGSEGV)
ddp = gradsync.DistributedDataParallel(torch.nn.Linear(2, 1))
"""


def _script(text: str, name: str = "train.py") -> Path:
    path = Path(tempfile.mkdtemp(prefix="sweep-run-")) / name
    path.write_text(text)
    return path


def _run(args: list[str], timeout: float = 40.0, **judge):
    return refused(gradsync_cli(["run", *args], timeout=timeout), **judge)


def _ran(proc) -> str:
    return f"exit 0; stdout {proc.stdout.strip()[-300:]!r}; stderr {proc.stderr.strip()[-300:]!r}"


@case(
    "run_master_port_in_use",
    CAT,
    "gradsync run --master-port P --nproc-per-node 2 with P already bound and listening",
    ["port", "in use"],
    timeout=60,
)
def _():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = ["--master-port", str(port), "--nproc-per-node", "2", str(_script(TRIVIAL))]
        return _ran(_run(args, one_line=True, must_contain=[f"port {port}"]))


@case(
    "run_rdzv_endpoint_port_in_use",
    CAT,
    "gradsync run --rdzv-endpoint localhost:P --nproc-per-node 2 with P taken",
    ["port"],
    timeout=60,
)
def _():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}", "--nproc-per-node", "2"]
        return _ran(_run([*args, str(_script(TRIVIAL))], one_line=True, must_contain=[str(port)]))


for _n in ("0", "-1"):

    @case(f"run_nproc_{_n}", CAT, f"gradsync run --nproc-per-node {_n}", ["--nproc-per-node", _n])
    def _(n=_n):
        return _ran(_run(["--nproc-per-node", n, str(_script(TRIVIAL))], one_line=True))


@case("run_nproc_abc", CAT, "gradsync run --nproc-per-node abc", ["--nproc-per-node", "abc"])
def _():
    return _ran(_run(["--nproc-per-node", "abc", str(_script(TRIVIAL))], one_line=True))


@case("run_nnodes_garbage", CAT, "gradsync run --nnodes two", ["--nnodes", "two"])
def _():
    return _ran(_run(["--nnodes", "two", "--nproc-per-node", "1", str(_script(TRIVIAL))], one_line=True))


@case(
    "run_max_restarts_negative",
    CAT,
    "gradsync run --max-restarts -1 (refuse it, or run as with 0)",
    ["--max-restarts"],
    check=lambda v: None if "trained 0" in v else f"did not train: {v}",
    timeout=60,
)
def _():
    return _ran(_run(["--max-restarts", "-1", "--nproc-per-node", "1", str(_script(TRIVIAL))], one_line=True))


@case("run_rdzv_endpoint_bad_port", CAT, "gradsync run --rdzv-endpoint localhost:notaport", ["notaport"], timeout=60)
def _():
    args = ["--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:notaport", "--nproc-per-node", "1"]
    return _ran(_run([*args, str(_script(TRIVIAL))], one_line=True))


@case("run_master_port_abc", CAT, "gradsync run --master-port abc", ["--master-port", "abc"])
def _():
    return _ran(_run(["--master-port", "abc", "--nproc-per-node", "1", str(_script(TRIVIAL))]))


@case("run_no_script", CAT, "gradsync run --nproc-per-node 2 (no script)", ["training_script"])
def _():
    return _ran(_run(["--nproc-per-node", "2"]))


@case("run_missing_script", CAT, "gradsync run --nproc-per-node 2 nothere.py", ["nothere.py"], timeout=60)
def _():
    return _ran(_run(["--nproc-per-node", "2", str(Path(tempfile.mkdtemp()) / "nothere.py")], code=None))


@case("run_unknown_flag", CAT, "gradsync run --nproc-per-node 2 --bogus 3 train.py", ["--bogus"], timeout=60)
def _():
    return _ran(_run(["--nproc-per-node", "2", "--bogus", "3", str(_script(TRIVIAL))]))


for _w in ("0", "-5"):

    @case(f"run_watchdog_{_w}", CAT, f"gradsync run --watchdog {_w}", ["--watchdog", _w])
    def _(w=_w):
        return _ran(_run(["--watchdog", w, "--nproc-per-node", "2", str(_script(TRIVIAL))], one_line=True))


@case("run_watchdog_abc", CAT, "gradsync run --watchdog abc", ["--watchdog", "abc"])
def _():
    return _ran(_run(["--watchdog", "abc", "--nproc-per-node", "2", str(_script(TRIVIAL))]))


@case(
    "run_watchdog_stops_hung_worker",
    CAT,
    "gradsync run --watchdog 5 --nproc-per-node 2 script.py, the workers hang forever after one step",
    ["--watchdog 5", "stuck_forever", "rank 0", "rank 1"],
    timeout=90,
)
def _():
    proc = _run(["--watchdog", "5", "--nproc-per-node", "2", str(_script(HANGS))], timeout=75, code=None)
    return _ran(proc)


@case(
    "run_worker_raises",
    CAT,
    "gradsync run --nproc-per-node 2, rank 1 raises ValueError('boom ...'): its traceback is shown (torchrun's "
    "way), and the launcher's final summary names rank 1 and the error",
    ["rank 1", "boom: bad shard on rank 1"],
    timeout=60,
)
def _():
    script = _script(RANK1_RAISES)
    judge = {"code": None, "user_script": str(script), "summary_from": "gradsync run: "}
    return _ran(_run(["--nproc-per-node", "2", str(script)], timeout=50, **judge))


@case(
    "run_worker_segfaults",
    CAT,
    "gradsync run --nproc-per-node 2, rank 1 dies of SIGSEGV",
    ["rank 1", "SIGSEGV"],
    timeout=60,
)
def _():
    return _ran(_run(["--nproc-per-node", "2", str(_script(RANK1_SEGFAULT))], timeout=50, code=None))


@case(
    "run_trivial_control",
    CAT,
    "gradsync run --nproc-per-node 2 of a correct script (control)",
    check=lambda v: None if "trained 0" in v and "trained 1" in v else f"did not train: {v}",
    timeout=60,
)
def _():
    return _ran(_run(["--nproc-per-node", "2", str(_script(TRIVIAL))], timeout=50))


@case("cli_unknown_command", CAT, "gradsync frobnicate", ["unknown command", "frobnicate"])
def _():
    return _ran(refused(gradsync_cli(["frobnicate"])))


# ------------------------------------------------------------------------------------------------ report
def _report(path: Path, *extra: str, code: int = 2):
    return _ran(refused(gradsync_cli(["report", str(path), *extra], timeout=60), code=code, one_line=True))


def _file(text: str, name: str = "trace.json") -> Path:
    path = Path(tempfile.mkdtemp(prefix="sweep-report-")) / name
    path.write_text(text)
    return path


def _trace(steps: int) -> Path:
    from gradsync.observe.recorder import BucketRecord, StepRecord
    from gradsync.observe.trace import write_chrome_trace

    records = []
    for s in range(steps):
        bucket = BucketRecord(0, 64, 2, 1.04 + s, 1.045 + s, 1.055 + s)
        records.append(StepRecord(1.0 + s, 1.01 + s, 1.011 + s, 1.05 + s, 1.06 + s, 1.07 + s, 1.08 + s, [bucket]))
    path = Path(tempfile.mkdtemp(prefix="sweep-report-")) / "trace.json"
    write_chrome_trace({0: records, 1: records}, path)
    return path


@case("report_missing_file", CAT, "gradsync report nothere.json", ["nothere.json"])
def _():
    return _report(Path(tempfile.mkdtemp()) / "nothere.json")


@case("report_empty_file", CAT, "gradsync report of a 0-byte file", ["trace.json"])
def _():
    return _report(_file(""))


@case("report_malformed_json", CAT, "gradsync report of '{\"traceEvents\": [' (cut short)", ["trace.json", "JSON"])
def _():
    return _report(_file('{"traceEvents": ['))


@case("report_other_json", CAT, "gradsync report of a JSON file that is not a trace", ["trace.json", "Monitor"])
def _():
    return _report(_file(json.dumps({"loss": [1.0, 0.5]})))


@case("report_json_list", CAT, "gradsync report of '[1, 2, 3]'", ["trace.json", "Monitor"])
def _():
    return _report(_file("[1, 2, 3]"))


@case("report_directory", CAT, "gradsync report of a directory", ["traces", "directory"])
def _():
    path = Path(tempfile.mkdtemp()) / "traces"
    path.mkdir()
    return _report(path)


@case("report_no_steps", CAT, "gradsync report of a gradsync trace holding no steps", ["no steps"])
def _():
    return _report(_trace(0), code=None)


@case("report_step_out_of_range", CAT, "gradsync report trace.json --step 99 (3 steps recorded)", ["--step", "99"])
def _():
    return _report(_trace(3), "--step", "99")


@case("report_out_unwritable", CAT, "gradsync report trace.json --out /proc/nope/plot.png", ["/proc/nope/plot.png"])
def _():
    return _report(_trace(3), "--out", "/proc/nope/plot.png")


@case(
    "report_control",
    CAT,
    "gradsync report of a good trace (control): table and PNG",
    check=lambda v: None if "wrote" in v else f"no PNG written: {v}",
    timeout=60,
)
def _():
    return _ran(refused(gradsync_cli(["report", str(_trace(3))], timeout=60)))
