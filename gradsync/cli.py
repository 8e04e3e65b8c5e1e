"""The ``gradsync`` command: ``gradsync run ...`` (launcher), ``gradsync doctor ...``, ``gradsync report ...``,
``gradsync plan ...``, ``gradsync --version``."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from gradsync import __version__
from gradsync.errors import ConfigError

USAGE = """usage: gradsync <command> [args]
       gradsync --version

commands:
  run      start a data-parallel job (torchrun's flags): gradsync run --nproc-per-node 2 train.py
  doctor   check this machine for a job with these flags: gradsync doctor --nnodes 2 --rdzv-endpoint node0:29400
  report   summarise a trace written by a training run: gradsync report trace.json
  plan     predict step time and scaling for a topology: gradsync plan --trace trace.json --hosts 1 4 32
  bench    not installed: run `python -m bench --help` from a source checkout
"""


def main(argv: Sequence[str] | None = None) -> int:
    """``gradsync <command>``: a user error prints one line and exits with 2, never a traceback."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return _dispatch(argv)
    except ConfigError as error:
        command = argv[0] if argv else ""
        print(f"gradsync {command}: {error.message}", file=sys.stderr)
        return 2


def _dispatch(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] == "--version":
        print(f"gradsync {__version__}")
        return 0
    command, rest = argv[0], argv[1:]
    if command == "run":
        from gradsync.launch.run import main as run_main

        return run_main(rest)
    if command == "doctor":
        from gradsync.doctor.report import main as doctor_main

        return doctor_main(rest)
    if command == "plan":
        from gradsync.planner import main as plan_main

        return plan_main(rest)
    if command == "report":
        from gradsync.observe.report import main as report_main

        return report_main(rest)
    if command == "bench":
        # The benchmarks sit above the library (bench/, in a source checkout): gradsync never imports them.
        print("gradsync bench: run `python -m bench ...` from a source checkout of gradsync", file=sys.stderr)
        return 2
    print(f"gradsync: unknown command '{command}'\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
