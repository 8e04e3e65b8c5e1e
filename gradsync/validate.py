"""Checks of public arguments at the boundary: each refuses a value of the wrong kind with a :class:`ConfigError`
that names the function and the argument, instead of a Python error from deep inside."""

from __future__ import annotations

import math
import numbers

from gradsync.errors import ConfigError


def require_int(where: str, name: str, value: object, minimum: int) -> int:
    """``value`` if it is an int >= ``minimum``, else a :class:`ConfigError` naming ``where``'s argument ``name``.

    A bool, a float or a numeric string is refused rather than converted: ``period='4'`` is a mistake to name.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ConfigError(f"{where}: {name} must be an int >= {minimum}, got {type(value).__name__} {value!r}")
    return int(value)


def require_number(where: str, name: str, value: object, minimum: float) -> float:
    """``value`` if it is a finite real number >= ``minimum``, else a :class:`ConfigError` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not minimum <= float(value) < math.inf:
        raise ConfigError(f"{where}: {name} must be a number >= {minimum:g}, got {type(value).__name__} {value!r}")
    return float(value)


_GRADSYNC_DDP = "gradsync.ddp.module.DistributedDataParallel"


def require_ddp(where: str, ddp: object) -> None:
    """A :class:`ConfigError` unless ``ddp`` is gradsync's DistributedDataParallel (what ``where`` attaches to)."""
    # By name, not isinstance: gradsync.ddp imports the modules that call this (through gradsync.comm), so importing
    # the class here would close an import loop between the folders (tests/test_layers.py refuses one).
    if any(f"{c.__module__}.{c.__qualname__}" == _GRADSYNC_DDP for c in type(ddp).__mro__):
        return
    kind = f"{type(ddp).__module__}.{type(ddp).__qualname__}"
    raise ConfigError(
        f"{where} attaches to a gradsync.DistributedDataParallel, got {kind}: wrap the model first "
        "(ddp = gradsync.DistributedDataParallel(model)) and pass ddp."
    )
