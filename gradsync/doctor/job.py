"""The flags of ``gradsync run`` that ``gradsync doctor``'s checks read, and where they put the job's store.

Parsed with ``gradsync run``'s own parser and checked with its own rules (gradsync/runtime/run_flags.py, which the
launcher uses too), the training script made optional: a flag the launcher refuses, doctor fails, in the same
words. The script and its arguments, and any flag neither knows, are accepted and not read, so a user can paste the
command they mean to run.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import dataclass

from gradsync.doctor.result import Result
from gradsync.errors import ConfigError
from gradsync.runtime import run_flags
from gradsync.runtime.endpoints import split

GLOO_IFNAME_VARIABLE = "GLOO_SOCKET_IFNAME"


@dataclass(frozen=True)
class Job:
    """What the checks need to know of the job: its size, where its store is, the interface gloo is told to use."""

    nnodes: str = "1"
    workers_per_node: str = "1"  # --nproc-per-node
    endpoint: str | None = None  # HOST:PORT of the rendezvous store; None: one node, on a free port it picks
    local_addr: str | None = None
    store: str | None = None  # --store etcd://...
    store_conf: str = ""  # --rdzv-conf, with --store: TLS files and user (gradsync/runtime/etcd_access.py)
    elastic: bool = False
    job_name: str = "none"  # --rdzv-id
    gloo_ifname: str | None = None
    ignored: tuple[str, ...] = ()
    refused: str | None = None  # what gradsync run would refuse in these flags, in its words

    @property
    def max_nodes(self) -> int:
        """The most nodes the job may span (``MIN:MAX`` for an elastic one); 1 where --nnodes is malformed."""
        return run_flags.max_nodes(self.nnodes)


def parse(argv: Sequence[str], environ: dict[str, str] | None = None) -> tuple[Job, bool]:
    """(the job these flags describe, whether --json was given)."""
    # A value the parser refuses (a duration that is nan, an unknown backend) is a refusal of the command: one line
    # and exit 2 from gradsync/cli.py, as gradsync run's. Flags the job's mode does not use are the flags check's.
    args, rest = _parser().parse_known_args(list(argv))
    environ = dict(os.environ if environ is None else environ)
    script = [args.training_script, *(args.training_script_args or [])] if args.training_script else []
    job = Job(
        nnodes=args.nnodes,
        workers_per_node=args.nproc_per_node,
        endpoint=_endpoint(args),
        local_addr=args.local_addr,
        store=args.store,
        store_conf=args.rdzv_conf,
        elastic=args.elastic,
        job_name=args.rdzv_id,
        gloo_ifname=environ.get(GLOO_IFNAME_VARIABLE) or None,
        ignored=(*rest, *script),
        refused=_refused(args, list(argv)),
    )
    return job, args.json


def _parser() -> argparse.ArgumentParser:
    p = run_flags.parser(prog="gradsync doctor", script=False)
    p.description = "Check this machine for a job with these gradsync run flags; exit 1 if the job would fail."
    p.add_argument("--json", action="store_true", help="print the checks as a JSON list instead of a table")
    return p


def _refused(args, argv: list[str]) -> str | None:
    try:
        run_flags.check(args, run_flags.given(argv, script=False))
    except ConfigError as error:
        return error.message
    return None


def _endpoint(args) -> str | None:
    """Where the rendezvous store will be, as ``gradsync run`` derives it; None where this node picks a free port
    (one node), or where the job's store is etcd's."""
    where = run_flags.endpoint(args)
    try:
        return None if where is None or split(where, where, run_flags.RDZV_PORT)[1] == 0 else where
    except ConfigError:
        return where  # check_flags names it, and the store check fails on it


def check_flags(job: Job) -> Result:
    """The flags themselves, refused as ``gradsync run`` would refuse them, before it starts anything."""
    if job.refused:
        return Result("flags", "fail", job.refused, "fix the flags as said: gradsync run refuses them too")
    detail = f"--nnodes {job.nnodes} --nproc-per-node {job.workers_per_node}"
    detail += f", store at {job.store or job.endpoint or 'a free port on this node'}"
    if job.ignored:
        detail += f"; not read by doctor: {' '.join(job.ignored)}"
    return Result("flags", "ok", detail)
