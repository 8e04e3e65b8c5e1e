"""The flags of ``gradsync run``, and their rules: which of its modes uses which flag, the values it refuses, and
where each mode puts the job's store. ``gradsync run`` (gradsync/launch/run.py) and ``gradsync doctor``
(gradsync/doctor/job.py) both parse with :func:`parser` and check with :func:`check`, so the doctor refuses exactly
what the launcher would, and neither keeps a copy of the other's rules.

No flag is taken and then ignored: a flag given on the command line to a mode that does not use it is refused, in
one line that says why (``UNUSED``). A ``PET_*`` variable for such a flag is not refused: Kubeflow's operator sets
them for every job (``PET_RDZV_ENDPOINT`` beside ``--store etcd://...``), whatever the command does with them.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import NoReturn

from torch.distributed.run import get_args_parser

from gradsync.errors import ConfigError
from gradsync.runtime import etcd_access, flag_values
from gradsync.runtime.endpoints import etcd_members, etcd_scheme, join, split
from gradsync.torch_private import privateuse1_backend_name

STATIC, STANDALONE, ELASTIC, ETCD = "static", "--standalone", "--elastic", "--elastic --store"
RDZV_PORT = 29400  # torch's c10d rendezvous port, where --rdzv-endpoint gives none
MASTER_PORT = 29500  # torchrun's --master-port

# Why a mode does not use a flag. {store}, {endpoint}, {backend}: the flags' values.
_STANDALONE = "--standalone serves the rendezvous on this node, on a free port"
_ETCD = "--store {store} holds the job's store"
_OWN_STORE = "--elastic serves the job's store from its launcher (on one node on a free port, else at --rdzv-endpoint)"
_NO_AGENT = "--elastic supervises each worker itself, not with torch's elastic agent"
_NO_WATCHDOG = "--elastic finds a stuck or lost worker by its heartbeat (gradsync.elastic.init(timeout=...))"
_RANKED = "gradsync run ranks the nodes in its rendezvous, by address (torch's c10d rendezvous, which restarts need)"
_ONE_STORE_EACH = "without --store the job's store is its launcher's own, one per job"
_AGENT_FLAGS = (
    "monitor_interval start_method event_log_handler role redirects tee local_ranks_filter duplicate_stdout_filters "
    "duplicate_stderr_filters logs_specs numa_binding signals_to_handle shutdown_timeout virtual_local_rank"
).split()

# flag (its dest) -> {a mode that does not use it: why}. A flag not listed is used by every mode.
UNUSED: dict[str, dict[str, str]] = {
    "rdzv_endpoint": {STANDALONE: _STANDALONE, ETCD: _ETCD},
    "master_addr": {STANDALONE: _STANDALONE, ETCD: _ETCD},
    "master_port": {STANDALONE: _STANDALONE, ETCD: _ETCD},
    "rdzv_backend": {STANDALONE: _STANDALONE, ELASTIC: _OWN_STORE, ETCD: _ETCD},
    "rdzv_conf": {ELASTIC: _OWN_STORE},  # with --store: how to reach etcd (TLS, user), gradsync/runtime/etcd_access.py
    "rdzv_id": {ELASTIC: _ONE_STORE_EACH},
    "standalone": {ELASTIC: _OWN_STORE, ETCD: _ETCD},
    "node_rank": dict.fromkeys((STATIC, STANDALONE, ELASTIC, ETCD), _RANKED),
    "watchdog": {ELASTIC: _NO_WATCHDOG, ETCD: _NO_WATCHDOG},
    **{flag: {ELASTIC: _NO_AGENT, ETCD: _NO_AGENT} for flag in _AGENT_FLAGS},
}
# flag -> (the flag that, given, makes it unused, why): torchrun reads --master-* only for its static rendezvous
# without an endpoint.
SUPERSEDED: dict[str, tuple[str, str]] = {
    "master_addr": ("rdzv_endpoint", "--rdzv-endpoint {endpoint} names the rendezvous"),
    "master_port": ("rdzv_endpoint", "--rdzv-endpoint {endpoint} names the rendezvous"),
}


def parser(prog: str = "gradsync run", script: bool = True) -> argparse.ArgumentParser:
    """torchrun's parser (its flags, ``PET_*`` variables as defaults), plus gradsync's own flags. ``script=False``:
    the training script may be left out (``gradsync doctor``)."""
    p = get_args_parser()
    p.prog = prog
    # A refusal in one line (gradsync/cli.py), not argparse's usage and its own exit.
    p.error = _refuse(prog)  # type: ignore[method-assign,assignment]
    p.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="gradsync: with a refusal, print its traceback too (as GRADSYNC_DEBUG=1 does)",
    )
    p.add_argument(
        "--watchdog",
        type=float,
        default=None,
        metavar="SECONDS",
        help="gradsync: stop the job, with every rank's Python stack, if no rank completes a step for SECONDS",
    )
    p.add_argument(
        "--elastic",
        action="store_true",
        help="gradsync: survivors keep training when a worker fails; only that worker restarts and rejoins "
        "(the script uses gradsync.elastic)",
    )
    p.add_argument(
        "--store",
        default=None,
        metavar="etcd://HOST:PORT,...",
        help="gradsync, with --elastic: keep the job's coordination state on this etcd cluster instead of in the "
        "rendezvous host's launcher, so that the job survives losing any one host; the job's keys live under "
        "gradsync/<--rdzv-id>/",
    )
    _check_values_by_kind(p)
    if not script:
        for action in p._actions:  # argparse has no public way to make a positional optional once added
            if action.dest in ("training_script", "training_script_args"):
                action.required = False
                action.nargs = "?" if action.dest == "training_script" else argparse.REMAINDER
    return p


def _check_values_by_kind(p: argparse.ArgumentParser) -> None:
    """Every flag's values checked when parsed, by the kind of value it takes: each float flag is a duration
    (:class:`Seconds`: NaN, inf, 0 and below mean nothing), torchrun's text and int flags their kind's parser."""
    checked = flag_values.kinds()
    for action in p._actions:
        if action.type is float:
            action.type = Seconds(flag_name(action.dest))
        elif action.dest in checked:
            action.type = checked[action.dest]


def _refuse(prog: str) -> Callable[[str], NoReturn]:
    """argparse's errors ("argument --nnodes: expected one argument") as gradsync's: one line, exit 2
    (gradsync/cli.py), not its usage."""

    def error(message: str) -> NoReturn:
        raise ConfigError(f"{message.removeprefix('argument ')} ({prog} --help lists the flags)")

    return error


@dataclasses.dataclass(frozen=True)
class Seconds:
    """The parser of every float flag (each one a duration): a finite number of seconds > 0. ``float("nan")``
    would make a watchdog that never fires, ``inf`` or 0 one that means nothing."""

    flag: str

    def __call__(self, text: str) -> float:
        try:
            seconds = float(text)
        except ValueError:
            seconds = math.nan
        if not (0 < seconds < math.inf):
            raise argparse.ArgumentTypeError(f"{text!r}: give a finite number of seconds > 0.")
        return seconds


def verbose(argv: Sequence[str]) -> bool:
    """Whether ``-v``/``--verbose`` is among these flags (not among the training script's arguments), read even
    where a value is refused (the refusal it asks the traceback of)."""
    lenient = parser(script=False)
    for action in lenient._actions:
        action.type, action.choices = None, None
    try:
        return bool(lenient.parse_known_args(list(argv))[0].verbose)
    except ConfigError:
        return False


def given(argv: Sequence[str], script: bool = True) -> set[str]:
    """The flags (their dests) given on this command line, as opposed to defaulted or read from ``PET_*``."""
    quiet = parser(script=script)
    for action in quiet._actions:  # not set_defaults: argparse would then convert SUPPRESS as a value
        action.default = argparse.SUPPRESS
    return set(vars(quiet.parse_known_args(list(argv))[0])) - {"training_script", "training_script_args"}


def mode(args: argparse.Namespace) -> str:
    if args.elastic:
        return ETCD if args.store else ELASTIC
    return STANDALONE if args.standalone else STATIC


def shown(value: str) -> str:
    """A flag's value as an error shows it: an empty one as ``''`` (``--nnodes ''``), not as nothing."""
    return value if value else "''"


def flag_name(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def check(args: argparse.Namespace, given_flags: set[str]) -> None:
    """Refuse, in one line that names the flag, what ``gradsync run`` would only fail on later (or ignore): bad
    values, a store that needs what it was not given, and a flag the mode does not use. Resolves no name."""
    _check_nproc(args.nproc_per_node)
    _check_nnodes(args.nnodes, args.standalone)
    if args.max_restarts < 0:
        raise ConfigError(f"--max-restarts {args.max_restarts}: give how many times to restart the job, >= 0.")
    etcd_access.conf_pairs(args.rdzv_conf)  # torch would refuse it only once the launch has begun
    _check_store(args)
    _refuse_unused(args, given_flags)
    where = endpoint(args)
    if where is not None:
        what = f"--rdzv-endpoint {where}" if args.rdzv_endpoint else f"--master-addr:--master-port {where}"
        split(where, what, RDZV_PORT)


def _refuse_unused(args: argparse.Namespace, given_flags: set[str]) -> None:
    values = {"store": args.store, "endpoint": args.rdzv_endpoint, "backend": args.rdzv_backend}
    for flag in sorted(given_flags):
        why = UNUSED.get(flag, {}).get(mode(args))
        if why is None and flag in SUPERSEDED and SUPERSEDED[flag][0] in given_flags:
            why = SUPERSEDED[flag][1]
        if why is None and flag in SUPERSEDED and mode(args) == STATIC and args.rdzv_backend != "static":
            why = "--rdzv-backend {backend} meets at --rdzv-endpoint (torch's c10d default: localhost:29400)"
        if why is not None:
            raise ConfigError(f"{why.format(**values)}: {flag_name(flag)} is not used; drop it.")


def _check_store(args: argparse.Namespace) -> None:
    if args.store is None:
        return
    if not args.elastic:
        raise ConfigError(f"--store {args.store}: the job's store is elastic's; add --elastic, or drop --store.")
    members = args.store.removeprefix(etcd_scheme(args.store) or "")
    if etcd_scheme(args.store) is None or "/" in members or "?" in members:
        raise ConfigError(
            f"--store {shown(args.store)}: give the etcd cluster's members, etcd://HOST:PORT,HOST:PORT,... or "
            "etcd+https://... (the job's name comes from --rdzv-id; TLS files and the user from --rdzv-conf)."
        )
    etcd_members(args.store)
    etcd_access.from_flags(args.store, args.rdzv_conf)
    if args.rdzv_id == "none":
        raise ConfigError(
            f"--store {args.store}: name the job with --rdzv-id NAME, the same on every node: its keys live under "
            "gradsync/NAME/ in etcd, where they outlive the job, so each job needs a name of its own."
        )


def _check_nproc(value: str) -> None:
    if value.lstrip("-").isdigit():
        if int(value) < 1:
            raise ConfigError(f"--nproc-per-node {shown(value)}: start at least 1 worker per node (or auto, cpu, gpu).")
    elif value not in ("auto", "cpu", "gpu", "xpu", privateuse1_backend_name()):
        raise ConfigError(
            f"--nproc-per-node {shown(value)}: give the number of workers per node (e.g. 2), or auto, cpu or gpu "
            "(one per CPU core or GPU)."
        )


def _check_nnodes(value: str, standalone: bool) -> None:
    parts = value.split(":")
    if len(parts) > 2 or not all(p.isdigit() for p in parts) or not 1 <= int(parts[0]) <= int(parts[-1]):
        raise ConfigError(
            f"--nnodes {shown(value)}: give the number of nodes (e.g. 2), or MIN:MAX for an elastic job (e.g. 1:4), "
            "with 1 <= MIN <= MAX."
        )
    if standalone and int(parts[-1]) > 1:
        raise ConfigError(
            f"--nnodes {value}: --standalone runs one node (its rendezvous is on a free port of this node); for "
            "several, drop --standalone and give --rdzv-endpoint HOST:PORT."
        )


def max_nodes(nnodes: str) -> int:
    """The most nodes the job may span (``MIN:MAX`` for an elastic one); 1 where --nnodes is malformed."""
    last = nnodes.split(":")[-1]
    return int(last) if last.isdigit() else 1


def endpoint(args: argparse.Namespace) -> str | None:
    """Where the job's TCP store (the rendezvous, or --elastic's store) is, HOST:PORT; port 0: a free one on this
    node. None where the mode has none (``--store etcd://``: nothing about an endpoint is defaulted)."""
    if mode(args) == ETCD:
        return None
    if args.standalone:
        return "localhost:0"
    if mode(args) == STATIC and args.rdzv_backend != "static":
        return args.rdzv_endpoint or f"localhost:{RDZV_PORT}"  # torch's c10d default
    if args.rdzv_endpoint:
        return args.rdzv_endpoint
    one_node = args.master_port is None and max_nodes(args.nnodes) == 1
    # One node: any free port (as torchrun), on --master-addr. MASTER_ADDR's convention: IPv6 without brackets.
    return join(args.master_addr.strip("[]"), 0 if one_node else args.master_port or MASTER_PORT)
