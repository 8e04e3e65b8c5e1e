"""``gradsync run``: torchrun's flags and worker environment on torch elastic, with restarts that work and
failures reported as a person needs them.

Why torchrun's restarts fail (docs/launching.md says how often): by default the c10d rendezvous builds its bootstrap
TCPStore once and every round's workers connect to it *without a per-attempt prefix*
(``torch/distributed/rendezvous.py`` assumes "a new TCPStore for every retry", which sharing breaks; the static
rendezvous always shares). Restarted workers then read the dead round's keys: gloo connects to the old workers'
ports ("Connection refused") or the init barrier counts stale arrivals (a hang). ``gradsync run`` turns sharing off
(``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``), so each round's rank 0 hosts a fresh store on a fresh port, and uses the
c10d rendezvous in place of the static one, which cannot do that (torch's c10d under a name of its own,
gradsync/launch/rendezvous.py, whose store listens on the endpoint's address only).
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.launcher.api import elastic_launch
from torch.distributed.run import config_from_args

from gradsync.launch import rendezvous, watchdog
from gradsync.log import log
from gradsync.runtime import etcd_access, run_flags, store_server
from gradsync.runtime.endpoints import split
from gradsync.store.etcd_store import parse_endpoints

STDERR_TAIL_LINES = 15


def _parser() -> argparse.ArgumentParser:
    """torchrun's parser, plus gradsync's own flags (gradsync/runtime/run_flags.py, which gradsync doctor shares)."""
    return run_flags.parser()


def _prepare(argv: Sequence[str]):
    args = _parser().parse_args(list(argv))
    run_flags.check(args, run_flags.given(argv))
    if args.store:
        parse_endpoints(args.store)  # each member resolves
        for exposed in etcd_access.exposed(etcd_access.from_flags(args.store, args.rdzv_conf)):
            log.warning(f"gradsync run: {exposed}")  # once, here: the workers are handed the same files
    where = run_flags.endpoint(args)
    if where is not None:  # the job's store is a TCPStore (not etcd's): where, and who serves it
        _serve_the_rendezvous(args, where)
    if args.master_port is None:
        args.master_port = run_flags.MASTER_PORT
    if not args.log_dir:
        args.log_dir = tempfile.mkdtemp(prefix="gradsync-run-")
    if args.tee == "0" and args.redirects == "0":
        args.tee = "2"  # keep each worker's stderr in a file too, so a failure report can quote it
    return args


def _serve_the_rendezvous(args: argparse.Namespace, where: str) -> None:
    """Point the job at its TCP store ``where``: torch elastic through gradsync's c10d rendezvous (whose store
    listens on the endpoint's address only: gradsync/launch/rendezvous.py), or --elastic's launcher. Refuse at once,
    naming the port, a store this node serves and cannot listen for (torch elastic would wait on it for minutes)."""
    if not args.elastic and args.rdzv_backend not in ("static", "c10d"):
        return  # torch's own rendezvous (etcd): its endpoint is etcd's, served by nobody here
    host, port = split(where, f"--rdzv-endpoint {where}", run_flags.RDZV_PORT)
    args.rdzv_endpoint = where
    if not args.elastic:
        args.rdzv_backend = rendezvous.register()
    if args.local_addr and host == args.local_addr and "is_host" not in args.rdzv_conf:
        # torch decides who hosts the rendezvous store by resolving the machine's hostname, which fails where the
        # hostname does not map to the serving interface (containers, namespaces): the node whose --local-addr is
        # the endpoint hosts it.
        args.rdzv_conf = ",".join(c for c in (args.rdzv_conf, "is_host=1") if c)
    nodes = run_flags.max_nodes(args.nnodes)
    if store_server.served_here(host, args.local_addr, args.elastic, nodes):
        store_server.check_port(host, port, nodes)
    if args.rdzv_id == "none":
        args.rdzv_id = f"gradsync-{where}"


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
    raised = exception_line(tails[first_rank])
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


def exception_line(tail: list[str]) -> str | None:
    """The last ``SomeError: message`` line of a worker's stderr: what the user's script raised (shared with
    gradsync/launch/elastic.py)."""
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
