"""The environment variables gradsync reads, parsed in one place: each is read once, where an object is built, and a
value gradsync cannot use is refused by name instead of being taken for something else.

========================== ========================================================================= =======
variable                   meaning                                                                   default
========================== ========================================================================= =======
``GRADSYNC_DEBUG``         compare every collective's fingerprint across ranks first                 off
``GRADSYNC_BUCKET_TUNING`` tune bucket sizes at the rebuild when ``bucket_cap_mb=None``              on
``GRADSYNC_TIMEOUT``       seconds before a collective fails instead of hanging                      600
``GRADSYNC_LENDING``       lend bucket slots to ``.grad`` instead of copying averages back           on
========================== ========================================================================= =======
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from gradsync.errors import ConfigError
from gradsync.validate import MAX_SECONDS, is_timeout

# The elastic job's store (host:port, or etcd://...), set by `gradsync run --elastic` for each of its workers.
ELASTIC_STORE_VARIABLE = "GRADSYNC_ELASTIC_STORE"

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def read_bool(name: str, default: bool, environ: Mapping[str, str] | None = None) -> bool:
    """``name`` as a boolean: 1/true/yes/on or 0/false/no/off (any case); unset or empty gives ``default``.

    >>> read_bool("GRADSYNC_DEBUG", False, {"GRADSYNC_DEBUG": "off"})
    False
    """
    value = _environment(environ).get(name, "").strip().lower()
    if not value:
        return default
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(f"{name}={value!r} is not a boolean: use one of {', '.join(_TRUE + _FALSE)}.")


def read_seconds(name: str, default: float, environ: Mapping[str, str] | None = None) -> float:
    """``name`` as a positive, finite number of seconds; unset or empty gives ``default``.

    >>> read_seconds("GRADSYNC_TIMEOUT", 600.0, {"GRADSYNC_TIMEOUT": "30"})
    30.0
    """
    value = _environment(environ).get(name, "").strip()
    if not value:
        return default
    try:
        seconds = float(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not a number of seconds (e.g. {name}=600).") from None
    if not is_timeout(seconds):
        raise ConfigError(
            f"{name}={value!r}: the timeout must be a positive number of seconds, at most {MAX_SECONDS:.0e} "
            f"(e.g. {name}=600)."
        )
    return seconds


def _environment(environ: Mapping[str, str] | None) -> Mapping[str, str]:
    if environ is None:
        return os.environ
    if not isinstance(environ, Mapping):
        raise ConfigError(f"environ must be a mapping of variable names to values, got {type(environ).__name__}")
    return environ


def debug(environ: Mapping[str, str] | None = None) -> bool:
    """``GRADSYNC_DEBUG``: check before each collective that every rank is about to issue the same one.

    >>> debug({"GRADSYNC_DEBUG": "1"})
    True
    """
    return read_bool("GRADSYNC_DEBUG", False, environ)


def bucket_tuning(environ: Mapping[str, str] | None = None) -> bool:
    """``GRADSYNC_BUCKET_TUNING``: with ``bucket_cap_mb=None``, let the tuner choose the caps at the rebuild.

    >>> bucket_tuning({})  # on unless GRADSYNC_BUCKET_TUNING=0
    True
    """
    return read_bool("GRADSYNC_BUCKET_TUNING", True, environ)


def lending(environ: Mapping[str, str] | None = None) -> bool:
    """``GRADSYNC_LENDING``: after the rebuild, let a fresh ``.grad`` point at its averaged bucket slot instead of
    copying the averages back (Lending in gradsync/reducer/buckets.py); off, the reducer copies back as torch's does.

    >>> lending({"GRADSYNC_LENDING": "0"})
    False
    """
    return read_bool("GRADSYNC_LENDING", True, environ)


def timeout_seconds(default: float, environ: Mapping[str, str] | None = None) -> float:
    """``GRADSYNC_TIMEOUT``: seconds before a collective fails instead of hanging.

    >>> timeout_seconds(600.0, {"GRADSYNC_TIMEOUT": "120"})
    120.0
    """
    return read_seconds("GRADSYNC_TIMEOUT", default, environ)


def in_elastic_job(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process is a worker of ``gradsync run --elastic`` (``GRADSYNC_ELASTIC_STORE`` set): a member
    lost during a collective is then a membership change, for the job's State to recover from.

    >>> in_elastic_job({"GRADSYNC_ELASTIC_STORE": "10.0.0.1:29500"}), in_elastic_job({})
    (True, False)
    """
    return bool(_environment(environ).get(ELASTIC_STORE_VARIABLE))
