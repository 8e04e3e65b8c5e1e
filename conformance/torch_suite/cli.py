"""``python -m conformance.torch_suite``: run torch's DDP tests with torch's and gradsync's DDP, side by side."""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from threading import Lock
from typing import Any

from conformance.torch_suite import report, selection
from conformance.torch_suite.runner import Outcome, run_test

DEFAULT_OUT = Path("conformance/results/torch_suite.json")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m conformance.torch_suite", description=__doc__)
    parser.add_argument("--ddp", choices=("torch", "gradsync", "both"), default="both")
    parser.add_argument("-k", action="append", default=[], metavar="SUBSTRING", help="run tests whose name has it")
    parser.add_argument("--jobs", type=int, default=1, help="tests run at once (each uses 3 processes)")
    parser.add_argument("--timeout-per-test", type=float, default=120.0, metavar="SECONDS")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="per-test JSON, merged with an earlier run")
    parser.add_argument("--fresh", action="store_true", help="ignore the results already in --out")
    parser.add_argument("--log-dir", type=Path, help="one log per test and DDP kind (default: a new temp dir)")
    parser.add_argument(
        "--start-method",
        choices=("spawn", "fork"),
        default="spawn",
        help="how ranks start: spawn re-imports torch in each rank as upstream does; fork is about twice as fast",
    )
    parser.add_argument("--list", action="store_true", help="print the selection and exit")
    parser.add_argument("--report-only", action="store_true", help="print the report of --out, run nothing")
    return parser.parse_args(argv)


def print_selection(selected: dict[str, str]) -> None:
    for name, base in selected.items():
        print(name if name == base else f"{name}  (from {base})")
    print(f"{len(selected)} tests; named like DDP tests but constructing no DDP, not run: {selection.keyword_only()}")


class Progress:
    """Runs (test, kind) pairs, records each outcome and rewrites the results file as it goes."""

    def __init__(self, args: argparse.Namespace, selected: dict[str, str], results: report.Results) -> None:
        self.args, self.selected, self.results = args, selected, results
        self.log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="torch_suite_logs_"))
        self.started = time.time()
        self.done = 0
        self.lock = Lock()

    def run(self, job: tuple[str, str], total: int) -> None:
        name, kind = job
        outcome = run_test(name, kind, self.args.timeout_per_test, self.log_dir, self.args.start_method)
        with self.lock:
            self.done += 1
            report.record(self.results, name, self.selected[name], kind, outcome)
            report.write(self.args.out, self.results, self.meta())
            print(f"[{self.done}/{total}] {name} {kind}: {describe(outcome)}", flush=True)

    def meta(self) -> dict[str, Any]:
        import torch

        return {
            "torch": torch.__version__,
            "backend": "gloo",
            "world_size": 2,
            "timeout_per_test_s": self.args.timeout_per_test,
            "last_run": {
                "ddp": self.args.ddp,
                "filter": self.args.k,
                "start_method": self.args.start_method,
                "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(self.started)),
                "duration_s": round(time.time() - self.started, 1),
                "logs": str(self.log_dir),
            },
            "not_run_keyword_only": selection.keyword_only(),
        }


def describe(outcome: Outcome) -> str:
    text = f"{outcome.status} ({outcome.seconds:.0f}s)"
    return f"{text}: {outcome.summary}" if outcome.summary else text


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    selected = selection.select(args.k)
    if args.list:
        print_selection(selected)
        return 0
    results = {} if args.fresh else report.load(args.out, selection.select(None))
    report.annotate(results)
    if args.report_only:
        # Refreshes the not-applicable marks; the results, and so the provenance, stay the run's that made them.
        report.write(args.out, results, report.load_meta(args.out), made_by=report.load_provenance(args.out))
    else:
        run_all(args, selected, results)
    print_report(results)
    print(f"\nresults: {args.out}")
    return 0


def run_all(args: argparse.Namespace, selected: dict[str, str], results: report.Results) -> None:
    kinds = list(report.KINDS) if args.ddp == "both" else [args.ddp]
    progress = Progress(args, selected, results)
    jobs = [(name, kind) for name in selected for kind in kinds]
    print(f"{len(selected)} tests x {kinds}; logs in {progress.log_dir}", flush=True)
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        list(pool.map(lambda job: progress.run(job, len(jobs)), jobs))
    report.write(args.out, results, progress.meta())
    print(f"ran {len(jobs)} test runs in {time.time() - progress.started:.0f} s")


def print_report(results: report.Results) -> None:
    print()
    print(report.format_table(results))
    print()
    print(report.format_regressions(results))
    passes = report.gradsync_only_passes(results)
    if passes:
        print(f"\npass with gradsync, fail with torch's DDP on this CPU mapping: {', '.join(passes)}")


if __name__ == "__main__":
    sys.exit(main())
