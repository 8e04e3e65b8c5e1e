"""The command lines and the environment: for each flag of ``gradsync run`` / ``gradsync doctor``, each
``--rdzv-conf`` key and each ``GRADSYNC_*`` variable, the wrong values users type. A flag's values are derived from
its parser (a switch takes none; ``choices`` give an unknown one; ``type=int``/``float`` give text, NaN, zero,
negative...) unless the table below says more; a ``str`` flag needs an entry (tests/test_generated_sweep.py checks).
"""

from __future__ import annotations

import argparse
from typing import Any

from conformance.sweep.generated.values import DIRECTORY, MISSING, NOT_PEM, Make, text_file

INT_BAD = (("text", "abc"), ("a fraction", "1.5"), ("negative", "-1"), ("empty", ""))
FLOAT_BAD = (("text", "abc"), ("NaN", "nan"), ("inf", "inf"), ("zero", "0"), ("negative", "-1"), ("huge", "1e400"))
A_FILE = Make(lambda: text_file("x\n"), "a file, not a directory")

# dest -> the wrong values ((label, value), ...), or a str: why no value of the flag's type is wrong.
FLAGS: dict[str, tuple[tuple[str, Any], ...] | str] = {
    "nnodes": (("zero", "0"), ("MIN > MAX", "2:1"), ("text", "abc"), ("empty", ""), ("three parts", "1:2:3")),
    "nproc_per_node": (("zero", "0"), ("negative", "-1"), ("text", "abc"), ("empty", ""), ("a fraction", "1.5")),
    "rdzv_backend": (("unknown", "nonsense"), ("empty", "")),
    "rdzv_endpoint": (
        ("port not a number", "localhost:port"),
        ("port out of range", "localhost:99999"),
        ("a URL", "http://localhost:29400"),
        ("only colons", ":::"),
    ),  # fmt: skip
    "rdzv_id": "a job's name: any text",
    "rdzv_conf": (("not KEY=VALUE", "novalue"),),
    "max_restarts": INT_BAD,
    "monitor_interval": FLOAT_BAD,
    "event_log_handler": (("unknown", "nonsense"),),
    "role": "a worker role's name: any text",
    "log_dir": (("a file", A_FILE),),
    "redirects": (("unknown", "9"), ("text", "abc")),
    "tee": (("unknown", "9"), ("text", "abc")),
    "local_ranks_filter": (("text", "abc"), ("negative", "-1")),
    "duplicate_stdout_filters": "filters of output lines: any text",
    "duplicate_stderr_filters": "filters of output lines: any text",
    "node_rank": INT_BAD,
    "master_addr": (("empty", ""), ("a URL", "http://node0")),
    "master_port": (*INT_BAD, ("out of range", "70000")),
    "local_addr": (("empty", ""),),
    "logs_specs": (("unknown", "nonsense"),),
    "signals_to_handle": (("unknown signal", "SIGNOPE"), ("text", "abc")),
    "shutdown_timeout": INT_BAD,
    "watchdog": FLOAT_BAD,
    "store": (
        ("no scheme", "localhost:2379"),
        ("http", "http://localhost:2379"),
        ("port not a number", "etcd://h:port"),
        ("a path", "etcd://localhost:2379/job"),
        ("empty", ""),
    ),  # fmt: skip
    "json": "a switch",
}
ETCD = ["--elastic", "--store", "etcd://127.0.0.1:2379", "--rdzv-id", "job"]
# The flags used only in some mode: the command line they are given in (else a static one-node job).
MODE: dict[str, list[str]] = {
    "store": ["--elastic", "--rdzv-id", "job"],
    "rdzv_conf": ["--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:29400"],
    "rdzv_backend": ["--rdzv-endpoint", "localhost:29400"],
    "rdzv_endpoint": ["--rdzv-backend", "c10d"],
}


def flag_values(action: argparse.Action) -> tuple[tuple[str, Any], ...] | str:
    """The wrong values of a flag: the table's, else derived from its parser entry; a str says why there are none."""
    if action.dest in FLAGS:
        return FLAGS[action.dest]
    if action.nargs == 0:
        return "a switch: it takes no value"
    if action.choices:
        return (("unknown", "nonsense"), ("empty", ""))
    if action.type is int:
        return INT_BAD
    if action.type is float:
        return FLOAT_BAD
    raise KeyError(action.dest)


# --rdzv-conf key -> (wrong values, the keys it needs beside it). torch's etcd-v2 aliases name the same files.
_FILE = (("missing path", MISSING), ("a directory", DIRECTORY), ("empty", ""))
_PEM = (*_FILE, ("not PEM", NOT_PEM))
_CLIENT_PEM = Make(lambda: text_file("not a certificate\n", ".pem"), "a file that is not PEM")
# A key's companion certificate: it must pass the certificate's own check (its PEM label, which is read first), so
# that the error judged is the key's.
_CERT_PEM = Make(
    lambda: text_file("-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n", ".pem"), "a PEM certificate"
)
RDZV_CONF: dict[str, tuple[tuple[tuple[str, Any], ...], dict[str, Any]]] = {
    "protocol": ((("unknown", "ftp"), ("empty", "")), {}),
    "cacert": (_PEM, {}),
    "cert": (_PEM, {"key": _CLIENT_PEM}),
    "key": (_PEM, {"cert": _CERT_PEM}),
    "password_file": (_FILE, {"user": "trainer"}),
    "user": ((("empty", ""),), {"password_file": Make(lambda: text_file("secret\n"), "a password file")}),
    "check_hostname": ((("not 0/1", "maybe"), ("empty", "")), {}),
    "password_over_http": ((("not 0/1", "maybe"), ("empty", "")), {}),
    "ca_cert": (_PEM, {}),
    "ssl_cert": (_PEM, {"ssl_cert_key": _CLIENT_PEM}),
    "ssl_cert_key": (_PEM, {"ssl_cert": _CERT_PEM}),
}

_BOOL_BAD = (("not a boolean", "maybe"), ("a number", "2"))
_SECONDS_BAD = (("text", "abc"), ("zero", "0"), ("negative", "-1"), ("NaN", "nan"), ("inf", "inf"),
                ("huge", "99999999999999"))  # fmt: skip
# variable -> (wrong values, what reads it: a name in READERS) or a str: why a user does not set it.
VARIABLES: dict[str, tuple[tuple[tuple[str, str], ...], str] | str] = {
    "GRADSYNC_DEBUG": (_BOOL_BAD, "ddp"),
    "GRADSYNC_BUCKET_TUNING": (_BOOL_BAD, "ddp"),
    "GRADSYNC_LENDING": (_BOOL_BAD, "ddp"),
    "GRADSYNC_TIMEOUT": (_SECONDS_BAD, "init"),
    "GRADSYNC_ELASTIC_HEARTBEAT_TIMEOUT": (_SECONDS_BAD, "timeouts"),
    "GRADSYNC_ELASTIC_COLLECTIVE_TIMEOUT": (_SECONDS_BAD, "timeouts"),
    "GRADSYNC_ELASTIC_ADMISSION_TIMEOUT": (_SECONDS_BAD, "timeouts"),
    "GRADSYNC_ELASTIC_STOPPED_SECONDS": (_SECONDS_BAD, "stopwatch"),
    "GRADSYNC_ELASTIC_STORE_LOST_SECONDS": (_SECONDS_BAD, "store_health"),
    "GRADSYNC_ETCD_PASSWORD": "a password: any text",
    "GRADSYNC_ELASTIC_REJOIN": "set by gradsync run --elastic on a restarted worker",
    "GRADSYNC_ELASTIC_STORE": "set by gradsync run --elastic for its workers",
    "GRADSYNC_ELASTIC_WORKER": "set by gradsync run --elastic for its workers",
    "GRADSYNC_ELASTIC_INCARNATION": "set by gradsync run --elastic for its workers",
    "GRADSYNC_MAX_WORLD_SIZE": "set by gradsync run --elastic for its workers",
    "GRADSYNC_WATCHDOG_DIR": "set by gradsync run --watchdog for its workers",
}


def _read_ddp() -> None:
    from conformance.sweep.generated import fixtures as fx

    fx.train(fx.ddp())


def _read_init() -> None:
    import gradsync
    from conformance.sweep.generated import fixtures as fx
    from gradsync.testing import free_port

    fx.world1_env(free_port())
    gradsync.init()


def _read_timeouts() -> None:
    from gradsync.elastic import Timeouts

    Timeouts.read(10.0, None, 600.0)


def _read_stopwatch() -> None:
    from gradsync.launch.stopped import StopWatch

    StopWatch()


def _read_store_health() -> None:
    from gradsync.store.job_store import StoreHealth

    StoreHealth()


READERS = {
    "ddp": _read_ddp,
    "init": _read_init,
    "timeouts": _read_timeouts,
    "stopwatch": _read_stopwatch,
    "store_health": _read_store_health,
}
