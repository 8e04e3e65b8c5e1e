"""``gradsync run``: torchrun's flags and worker environment on torch elastic, with restarts that work and
failures reported as a person needs them.

Why torchrun's restarts fail (measured on torch 2.13 + gloo: 1–2 clean restarts in 4): by default the c10d
rendezvous builds its bootstrap TCPStore once and every round's workers connect to it *without a per-attempt
prefix* (``torch/distributed/rendezvous.py`` assumes "a new TCPStore for every retry", which sharing breaks; the
static rendezvous always shares). Restarted workers then read the dead round's keys: gloo connects to the old
workers' ports ("Connection refused") or the init barrier counts stale arrivals (a hang). ``gradsync run`` turns
sharing off (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``), so each round's rank 0 hosts a fresh store on a fresh
port, and uses the c10d rendezvous in place of the static one, which cannot do that.
"""

from __future__ import annotations

import glob
import os
import sys
import tempfile
from collections.abc import Sequence

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import elastic_launch
from torch.distributed.run import config_from_args, get_args_parser

STDERR_TAIL_LINES = 15


def _prepare(argv: Sequence[str]):
    parser = get_args_parser()
    parser.prog = "gradsync run"
    args = parser.parse_args(list(argv))
    if args.standalone:
        args.rdzv_backend, args.rdzv_endpoint = "c10d", "localhost:0"
    elif args.rdzv_backend == "static":
        if args.master_port is None and not args.rdzv_endpoint and args.nnodes in ("1", "1:1"):
            args.rdzv_endpoint = "localhost:0"  # one node: any free port, as torchrun does
        else:
            args.rdzv_endpoint = args.rdzv_endpoint or f"{args.master_addr}:{args.master_port or 29500}"
        args.rdzv_backend = "c10d"
    endpoint_host = args.rdzv_endpoint.rsplit(":", 1)[0]
    if args.local_addr and endpoint_host == args.local_addr and "is_host" not in args.rdzv_conf:
        # torch decides who hosts the rendezvous store by resolving the machine's hostname, which fails where the
        # hostname does not map to the serving interface (containers, namespaces): the node whose --local-addr is
        # the endpoint hosts it.
        args.rdzv_conf = ",".join(c for c in (args.rdzv_conf, "is_host=1") if c)
    if args.rdzv_id == "none":
        args.rdzv_id = f"gradsync-{args.rdzv_endpoint}"
    if args.master_port is None:
        args.master_port = 29500
    if not args.log_dir:
        args.log_dir = tempfile.mkdtemp(prefix="gradsync-run-")
    if args.tee == "0" and args.redirects == "0":
        args.tee = "2"  # keep each worker's stderr in a file too, so a failure report can quote it
    return args


def _stderr_tail(log_dir: str, local_rank: int) -> list[str]:
    files = glob.glob(os.path.join(log_dir, "**", "attempt_*", str(local_rank), "stderr.log"), recursive=True)
    if not files:
        return []
    latest = max(files, key=lambda f: int(f.split("attempt_")[-1].split(os.sep)[0]))
    with open(latest, errors="replace") as fh:
        return [line.rstrip("\n") for line in fh.readlines()[-STDERR_TAIL_LINES:]]


def failure_report(error: ChildFailedError, log_dir: str, max_restarts: int) -> str:
    """Which ranks failed, how (exit code or signal), and the end of their stderr."""
    host = os.uname().nodename
    lines = [f"gradsync run: the job failed after {max_restarts} restart(s) allowed (--max-restarts)."]
    first_rank, _ = error.get_first_failure()
    for rank, failure in sorted(error.failures.items()):
        how = f"killed by {failure.signal_name()}" if failure.exitcode < 0 else f"exit code {failure.exitcode}"
        first = " <- failed first" if rank == first_rank else ""
        lines.append(f"  rank {rank} (local rank {failure.local_rank} on {host}, pid {failure.pid}): {how}{first}")
        tail = _stderr_tail(log_dir, failure.local_rank)
        if tail:
            lines.append("    last lines of its stderr:")
            lines.extend(f"      {line}" for line in tail)
    lines.append(f"  The other workers were stopped. All logs: {log_dir}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``gradsync run``; returns the process exit code."""
    args = _prepare(sys.argv[1:] if argv is None else argv)
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    config, cmd, cmd_args = config_from_args(args)
    try:
        elastic_launch(config=config, entrypoint=cmd)(*cmd_args)
    except ChildFailedError as error:
        print(failure_report(error, args.log_dir, args.max_restarts), file=sys.stderr, flush=True)
        codes = [f.exitcode for f in error.failures.values() if f.exitcode > 0]
        return codes[0] if codes else 1
    return 0
