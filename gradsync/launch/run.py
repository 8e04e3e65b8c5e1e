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

import argparse
import glob
import os
import re
import socket
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint
from torch.distributed.launcher.api import elastic_launch
from torch.distributed.run import config_from_args, get_args_parser

from gradsync import torch_private
from gradsync.elastic.etcd_store import parse_endpoints
from gradsync.elastic.job_store import is_etcd
from gradsync.errors import ConfigError
from gradsync.launch import watchdog

STDERR_TAIL_LINES = 15


def _parser() -> argparse.ArgumentParser:
    """torchrun's parser, plus gradsync's own flags."""
    parser = get_args_parser()
    parser.prog = "gradsync run"
    parser.add_argument(
        "--watchdog",
        type=float,
        default=None,
        metavar="SECONDS",
        help="gradsync: stop the job, with every rank's Python stack, if no rank completes a step for SECONDS",
    )
    parser.add_argument(
        "--elastic",
        action="store_true",
        help="gradsync: survivors keep training when a worker fails; only that worker restarts and rejoins "
        "(the script uses gradsync.elastic)",
    )
    parser.add_argument(
        "--store",
        default=None,
        metavar="etcd://HOST:PORT,...",
        help="gradsync, with --elastic: keep the job's coordination state on this etcd cluster instead of in the "
        "rendezvous host's launcher, so that the job survives losing any one host; the job's keys live under "
        "gradsync/<--rdzv-id>/",
    )
    return parser


def _prepare(argv: Sequence[str]):
    args = _parser().parse_args(list(argv))
    _check_flags(args)
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
    _check_endpoint_port(args.rdzv_endpoint, args.local_addr)
    if args.rdzv_id == "none":
        args.rdzv_id = f"gradsync-{args.rdzv_endpoint}"
    if args.master_port is None:
        args.master_port = 29500
    if not args.log_dir:
        args.log_dir = tempfile.mkdtemp(prefix="gradsync-run-")
    if args.tee == "0" and args.redirects == "0":
        args.tee = "2"  # keep each worker's stderr in a file too, so a failure report can quote it
    return args


def _check_flags(args: argparse.Namespace) -> None:
    """torchrun parses these flags only once it starts, with a traceback; refuse a bad one by name here."""
    if args.watchdog is not None and args.watchdog <= 0:
        raise ConfigError(f"--watchdog {args.watchdog}: give the seconds without progress to allow, > 0.")
    _check_nproc(args.nproc_per_node)
    _check_nnodes(args.nnodes)
    if args.max_restarts < 0:
        raise ConfigError(f"--max-restarts {args.max_restarts}: give how many times to restart the job, >= 0.")
    _check_store(args)
    if args.rdzv_endpoint:
        try:
            parse_rendezvous_endpoint(args.rdzv_endpoint, default_port=29400)
        except ValueError as exc:
            raise ConfigError(
                f"--rdzv-endpoint {args.rdzv_endpoint}: {exc} Give HOST:PORT, e.g. node0:29400."
            ) from None


def _check_store(args: argparse.Namespace) -> None:
    if args.store is None:
        return
    if not args.elastic:
        raise ConfigError(f"--store {args.store}: the job's store is elastic's; add --elastic, or drop --store.")
    if not is_etcd(args.store) or "/" in args.store.removeprefix("etcd://"):
        raise ConfigError(
            f"--store {args.store}: give the etcd cluster's members, etcd://HOST:PORT,HOST:PORT,... (the job's "
            "name comes from --rdzv-id)."
        )
    parse_endpoints(args.store)
    if args.rdzv_id == "none":
        raise ConfigError(
            f"--store {args.store}: name the job with --rdzv-id NAME, the same on every node: its keys live under "
            "gradsync/NAME/ in etcd, where they outlive the job, so each job needs a name of its own."
        )


def _check_nproc(value: str) -> None:
    if value.lstrip("-").isdigit():
        if int(value) < 1:
            raise ConfigError(f"--nproc-per-node {value}: start at least 1 worker per node (or auto, cpu, gpu).")
    elif value not in ("auto", "cpu", "gpu", "xpu", torch_private.privateuse1_backend_name()):
        raise ConfigError(
            f"--nproc-per-node {value}: give the number of workers per node (e.g. 2), or auto, cpu or gpu (one per "
            "CPU core or GPU)."
        )


def _check_nnodes(value: str) -> None:
    parts = value.split(":")
    if len(parts) > 2 or not all(p.isdigit() for p in parts) or not 1 <= int(parts[0]) <= int(parts[-1]):
        raise ConfigError(
            f"--nnodes {value}: give the number of nodes (e.g. 2), or MIN:MAX for an elastic job (e.g. 1:4), "
            "with 1 <= MIN <= MAX."
        )


def _check_endpoint_port(endpoint: str, local_addr: str | None) -> None:
    """Fail at once, naming the port, if this node must serve the rendezvous and the port is taken (torch elastic
    would wait on it for minutes: another job on that port, or a leftover process)."""
    host, _, port = endpoint.rpartition(":")
    if not port.isdigit() or int(port) == 0 or host not in ("localhost", "127.0.0.1", "0.0.0.0", local_addr or ""):
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", int(port)))
        except OSError as exc:
            raise ConfigError(
                f"port {port} (the rendezvous/master port) cannot be bound on this host: {exc.strerror}. Another "
                "job may be using it; pick a free one with --master-port or --rdzv-endpoint HOST:PORT."
            ) from None


def _stderr_tail(log_dir: str, local_rank: int) -> list[str]:
    files = glob.glob(os.path.join(log_dir, "**", "attempt_*", str(local_rank), "stderr.log"), recursive=True)
    if not files:
        return []
    latest = max(files, key=lambda f: int(f.split("attempt_")[-1].split(os.sep)[0]))
    with open(latest, errors="replace") as fh:
        lines = [line.rstrip("\n") for line in fh.readlines()]
    # A watchdog dump (faulthandler) is long: show it whole, from its first line.
    dump = next((k for k, line in enumerate(lines) if line.startswith(("Thread 0x", "Current thread 0x"))), None)
    return lines[dump:] if dump is not None else lines[-STDERR_TAIL_LINES:]


def failure_report(error: ChildFailedError, log_dir: str, max_restarts: int) -> str:
    """Which rank failed first and with what error, then every failed rank: how (exit code or signal), and the end
    of its stderr."""
    host = os.uname().nodename
    first_rank, first = error.get_first_failure()
    tails = {rank: _stderr_tail(log_dir, f.local_rank) for rank, f in error.failures.items()}
    raised = _exception_line(tails[first_rank])
    lines = [
        f"gradsync run: rank {first_rank} failed first{': ' + raised if raised else ''} ({_how(first)}); the job "
        f"stopped after {max_restarts} restart(s) allowed (--max-restarts)."
    ]
    for rank, failure in sorted(error.failures.items()):
        mark = " <- failed first" if rank == first_rank else ""
        lines.append(
            f"  rank {rank} (local rank {failure.local_rank} on {host}, pid {failure.pid}): {_how(failure)}{mark}"
        )
        if tails[rank]:
            lines.append("    last lines of its stderr:")
            lines.extend(f"      {line}" for line in tails[rank])
    lines.append(f"  The other workers were stopped. All logs: {log_dir}")
    return "\n".join(lines)


def _how(failure: ProcessFailure) -> str:
    return f"killed by {failure.signal_name()}" if failure.exitcode < 0 else f"exit code {failure.exitcode}"


# A worker's stderr lines carry torch elastic's "[rankN]: " prefix; an exception's last line is not indented.
_RANK_PREFIX = re.compile(r"^\[rank\d+\]: ?")
_EXCEPTION = re.compile(r"^(?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception|Exit|Interrupt)(?::.*)?$")


def _exception_line(tail: list[str]) -> str | None:
    """The last ``SomeError: message`` line of a worker's stderr: what the user's script raised."""
    for line in reversed(tail):
        text = _RANK_PREFIX.sub("", line)
        if _EXCEPTION.match(text):
            return text.strip()
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``gradsync run``; returns the process exit code."""
    args = _prepare(sys.argv[1:] if argv is None else argv)
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    config, cmd, cmd_args = config_from_args(args)
    if args.elastic:
        from gradsync.launch.elastic import run_elastic

        args.nproc_per_node = str(config.nproc_per_node)  # "auto", "cpu", "gpu" resolved as torchrun does
        return run_elastic(args, cmd if isinstance(cmd, str) else sys.executable, list(cmd_args))
    dog = _start_watchdog(args.watchdog, args.log_dir) if args.watchdog else None
    try:
        elastic_launch(config=config, entrypoint=cmd)(*cmd_args)
    except ChildFailedError as error:
        print(failure_report(error, args.log_dir, args.max_restarts), file=sys.stderr, flush=True)
        codes = [f.exitcode for f in error.failures.values() if f.exitcode > 0]
        return codes[0] if codes else 1
    finally:
        if dog is not None:
            dog.stop()
    return 0


def _start_watchdog(seconds: float, log_dir: str) -> watchdog.Watchdog:
    folder = Path(log_dir) / "progress"
    folder.mkdir(parents=True, exist_ok=True)
    os.environ[watchdog.FOLDER_VARIABLE] = str(folder)  # the workers inherit it and mark their progress there

    def on_stall(idle: float) -> None:
        workers = watchdog.child_pids()
        registered = watchdog.registered_pids(folder)
        silent = len([pid for pid in workers if pid not in registered])
        no_stack = f" {silent} worker(s) never built a DistributedDataParallel: no stack to give." if silent else ""
        print(
            f"gradsync run: no rank completed a step for {idle:.0f}s (--watchdog {seconds:g}); asking the "
            f"{len(workers) - silent} worker(s) here for their Python stacks, then stopping the job." + no_stack,
            file=sys.stderr,
            flush=True,
        )
        watchdog.dump_stacks_and_stop(workers, registered)

    dog = watchdog.Watchdog(folder, seconds, on_stall)
    dog.start()
    return dog
