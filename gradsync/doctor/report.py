"""``gradsync doctor``: every check for this machine and these flags, as a table or as JSON, and the exit status
(1 when a job with these flags would fail here, else 0).

``--json`` prints a list with one object per check: ``{"name", "status", "detail", "fix", "optional"}``, where
``status`` is ``"ok"``, ``"warn"``, ``"fail"`` or ``"skip"`` and ``optional`` marks what only the lab needs.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence

from rich.console import Console
from rich.table import Table

from gradsync.doctor import backends, kernel, network, reverse_lookup, store, torch_checks
from gradsync.doctor.job import Job, check_flags, parse
from gradsync.doctor.result import Result, fails_a_job

_STYLES = {"ok": "green", "warn": "yellow", "fail": "bold red", "skip": "dim"}


def run_checks(job: Job) -> list[Result]:
    """Every check, in the order a job needs them: software, backends, network, store; the lab's last."""
    return [
        check_flags(job),
        torch_checks.check_python(),
        torch_checks.check_gradsync(),
        torch_checks.check_torch(),
        torch_checks.check_private_names(),
        backends.check_gloo(),
        backends.check_gpus(job),
        network.check_interface(job),
        reverse_lookup.check_reverse_lookup(job),
        store.check_rendezvous(job),
        store.check_etcd(job),
        *kernel.check_lab(),
    ]


def table(results: list[Result]) -> Table:
    verdict = "a job with these flags would fail here" if fails_a_job(results) else "nothing stops a job here"
    shown = Table(
        title="gradsync doctor",
        expand=True,  # the columns' ratios apply only to a table as wide as the terminal
        caption=f"{verdict} (exit status {int(fails_a_job(results))}); the lab rows are optional: only gradsync's lab "
        "(its namespace tests and benchmarks) needs them",
    )
    shown.add_column("check", no_wrap=True)
    shown.add_column("status", no_wrap=True)
    shown.add_column("found", ratio=3)
    shown.add_column("what to do", ratio=2)
    for r in results:
        style = _STYLES[r.status]
        shown.add_row(r.name, f"[{style}]{r.status}[/{style}]", r.detail, r.fix)
    return shown


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``gradsync doctor``; returns the exit status."""
    job, as_json = parse(sys.argv[1:] if argv is None else argv)
    results = run_checks(job)
    if as_json:
        print(json.dumps([r.as_json() for r in results], indent=1))
    else:
        Console().print(table(results))
    return 1 if fails_a_job(results) else 0
