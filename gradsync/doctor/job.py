"""The flags of ``gradsync run`` that ``gradsync doctor``'s checks read, and where they put the job's store.

Parsed here rather than with the launcher's parser: the library below the launchers never imports them (doctor
included), and ``gradsync run``'s parser wants a training script, which doctor does not. Any other flag of a
``gradsync run`` command line (and the script and its arguments) is accepted and ignored, so a user can paste the
command they mean to run.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import dataclass

from gradsync.doctor.result import Result
from gradsync.torch_private import privateuse1_backend_name

GLOO_IFNAME_VARIABLE = "GLOO_SOCKET_IFNAME"


@dataclass(frozen=True)
class Job:
    """What the checks need to know of the job: its size, where its store is, the interface gloo is told to use."""

    nnodes: str = "1"
    workers_per_node: str = "1"  # --nproc-per-node
    endpoint: str | None = None  # HOST:PORT of the rendezvous store; None: one node, on a free port it picks
    local_addr: str | None = None
    store: str | None = None  # --store etcd://...
    elastic: bool = False
    job_name: str = "none"  # --rdzv-id
    gloo_ifname: str | None = None
    ignored: tuple[str, ...] = ()

    @property
    def max_nodes(self) -> int:
        """The most nodes the job may span (``MIN:MAX`` for an elastic one); 1 where --nnodes is malformed."""
        last = self.nnodes.split(":")[-1]
        return int(last) if last.isdigit() else 1


def parser() -> argparse.ArgumentParser:
    """``gradsync doctor [--json] [gradsync run's flags]``: torchrun's spellings, dashes or underscores."""
    p = argparse.ArgumentParser(
        prog="gradsync doctor",
        allow_abbrev=False,  # a training script's own flags must not match ours by prefix
        description="Check this machine for a job with these gradsync run flags; exit 1 if the job would fail.",
    )
    p.add_argument("--json", action="store_true", help="print the checks as a JSON list instead of a table")
    p.add_argument("--nnodes", default="1", help="as gradsync run: N, or MIN:MAX for an elastic job")
    p.add_argument("--nproc-per-node", "--nproc_per_node", default="1", help="as gradsync run: N, auto, cpu, gpu")
    p.add_argument("--rdzv-backend", "--rdzv_backend", default="static")
    p.add_argument("--rdzv-endpoint", "--rdzv_endpoint", default="", help="HOST:PORT of the rendezvous store")
    p.add_argument("--rdzv-id", "--rdzv_id", default="none")
    p.add_argument("--master-addr", "--master_addr", default="127.0.0.1")
    p.add_argument("--master-port", "--master_port", type=int, default=None)
    p.add_argument("--local-addr", "--local_addr", default=None)
    p.add_argument("--standalone", action="store_true")
    p.add_argument("--elastic", action="store_true")
    p.add_argument("--store", default=None, metavar="etcd://HOST:PORT,...")
    return p


def parse(argv: Sequence[str], environ: dict[str, str] | None = None) -> tuple[Job, bool]:
    """(the job these flags describe, whether --json was given)."""
    args, rest = parser().parse_known_args(list(argv))
    environ = dict(os.environ if environ is None else environ)
    job = Job(
        nnodes=args.nnodes,
        workers_per_node=args.nproc_per_node,
        endpoint=_endpoint(args),
        local_addr=args.local_addr,
        store=args.store,
        elastic=args.elastic,
        job_name=args.rdzv_id,
        gloo_ifname=environ.get(GLOO_IFNAME_VARIABLE) or None,
        ignored=tuple(rest),
    )
    return job, args.json


def _endpoint(args: argparse.Namespace) -> str | None:
    """Where the rendezvous store will be, as ``gradsync run`` derives it (launch/run.py, ``_prepare``)."""
    if args.standalone:
        return None
    if args.rdzv_backend == "static":
        if args.master_port is None and not args.rdzv_endpoint and args.nnodes in ("1", "1:1"):
            return None  # one node: any free port
        return args.rdzv_endpoint or f"{args.master_addr}:{args.master_port or 29500}"
    return args.rdzv_endpoint or "localhost:29400"  # torch's c10d default


def check_flags(job: Job) -> Result:
    """The flags themselves, refused as ``gradsync run`` would refuse them, before it starts anything."""
    problems = [
        p for p in (_nnodes_problem(job.nnodes), _nproc_problem(job.workers_per_node), _store_problem(job)) if p
    ]
    if problems:
        return Result("flags", "fail", "; ".join(problems), "fix the flags as said: gradsync run refuses them too")
    detail = f"--nnodes {job.nnodes} --nproc-per-node {job.workers_per_node}"
    detail += f", store at {job.store or job.endpoint or 'a free port on this node'}"
    if job.ignored:
        detail += f"; not read by doctor: {' '.join(job.ignored)}"
    return Result("flags", "ok", detail)


def _nnodes_problem(value: str) -> str | None:
    parts = value.split(":")
    if len(parts) > 2 or not all(p.isdigit() for p in parts) or not 1 <= int(parts[0]) <= int(parts[-1]):
        return f"--nnodes {value}: give N, or MIN:MAX with 1 <= MIN <= MAX"
    return None


def _nproc_problem(value: str) -> str | None:
    if value.isdigit() and int(value) >= 1:
        return None
    if value in ("auto", "cpu", "gpu", "xpu", privateuse1_backend_name()):
        return None
    return f"--nproc-per-node {value}: give a number of workers >= 1, or auto, cpu or gpu"


def _store_problem(job: Job) -> str | None:
    if job.store is None:
        return None
    if not job.elastic:
        return f"--store {job.store}: the job's store is elastic's; add --elastic, or drop --store"
    if not job.store.startswith("etcd://") or "/" in job.store.removeprefix("etcd://"):
        return f"--store {job.store}: give the etcd members, etcd://HOST:PORT,HOST:PORT,..."
    if job.job_name == "none":
        return f"--store {job.store}: name the job with --rdzv-id NAME, the same on every node"
    return None
