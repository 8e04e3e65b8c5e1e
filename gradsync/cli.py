"""The ``gradsync`` command: ``gradsync run ...`` (launcher), ``gradsync doctor ...``, ``gradsync report ...``,
``gradsync plan ...``, ``gradsync --version``."""

from __future__ import annotations

import sys
import traceback
from collections.abc import Sequence

from gradsync import __version__, settings
from gradsync.errors import GradsyncError

USAGE = """usage: gradsync [-v] <command> [args]
       gradsync --version

commands:
  run      start a data-parallel job (torchrun's flags): gradsync run --nproc-per-node 2 train.py
  doctor   check this machine for a job with these flags: gradsync doctor --nnodes 2 --rdzv-endpoint node0:29400
  report   summarise a trace written by a training run: gradsync report trace.json
  plan     predict step time and scaling for a topology: gradsync plan --trace trace.json --hosts 1 4 32
  bench    not installed: run `python -m bench --help` from a source checkout

A refusal is one line on stderr and exit status 2; -v (or --verbose, or GRADSYNC_DEBUG=1) adds its traceback.
"""

VERBOSE = ("-v", "--verbose")
# torch's errors of a store or a rendezvous that refused or did not answer: refusals too, where torch is loaded.
_TORCH_REFUSALS = {"torch.distributed": "DistError", "torch.distributed.elastic.rendezvous.api": "RendezvousError"}


def refusals() -> tuple[type[BaseException], ...]:
    """What a command refuses with: gradsync's own errors (a bad flag, an etcd member refusing this client), what the
    operating system or OpenSSL says of a file or a connection the flags name (``OSError``, ``ssl.SSLError``), and
    torch's store and rendezvous errors. Anything else is a bug: its traceback is shown."""
    loaded = [getattr(sys.modules.get(module), name, None) for module, name in _TORCH_REFUSALS.items()]
    return (GradsyncError, OSError, *(kind for kind in loaded if isinstance(kind, type)))


def main(argv: Sequence[str] | None = None) -> int:
    """``gradsync <command>``: a refusal prints one line and exits with 2; its traceback only with ``-v`` (before
    the command or among its flags) or ``GRADSYNC_DEBUG=1``. The one place where the commands' refusals end."""
    argv = list(sys.argv[1:] if argv is None else argv)
    verbose = bool(argv) and argv[0] in VERBOSE
    argv = argv[1:] if verbose else argv
    try:
        return _dispatch(argv)
    except Exception as error:
        if not isinstance(error, refusals()):
            raise
        if verbose or _asks_for_tracebacks(argv):
            traceback.print_exc()
        print(f"gradsync {argv[0] if argv else ''}: {_one_line(error)}", file=sys.stderr)
        return 2


def _one_line(error: BaseException) -> str:
    said = error.message if isinstance(error, GradsyncError) else f"{type(error).__name__}: {error}"
    return " ".join(said.split())  # a message of several lines (an OpenSSL one, say) as one


def _asks_for_tracebacks(argv: list[str]) -> bool:
    """``GRADSYNC_DEBUG`` on, or ``-v`` among the command's own flags (``gradsync run`` and ``gradsync doctor``
    take it: gradsync/runtime/run_flags.py); a ``-v`` after the training script is the script's."""
    try:
        debug = settings.debug()
    except GradsyncError:
        debug = False  # a malformed GRADSYNC_DEBUG is refused where it is read; here it asks for nothing
    if debug or len(argv) < 2 or argv[0] not in ("run", "doctor"):
        return debug
    from gradsync.runtime import run_flags

    return run_flags.verbose(argv[1:])


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
