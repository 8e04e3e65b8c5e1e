"""Checks of public arguments at the boundary: each refuses a value of the wrong kind with a :class:`ConfigError`
that names the function and the argument, instead of a Python error from deep inside."""

from __future__ import annotations

import math
import numbers

from gradsync.errors import ConfigError

# The longest wait a timeout may be, about 31 years: "never" in practice. Past ~8.6e13 s a datetime.timedelta
# overflows, past ~9.2e12 s gloo refuses the timeout as negative (its microseconds overflow int64).
MAX_SECONDS = 1e9


def is_timeout(seconds: float) -> bool:
    """Whether ``seconds`` is a timeout a wait can take: > 0 (NaN never fires, 0 or less at once) and at most
    :data:`MAX_SECONDS` (inf or 1e30 overflow a ``timedelta`` or gloo's timeout). The one rule of the
    ``GRADSYNC_*_TIMEOUT`` variables, ``init(timeout=)`` and the constructors that take seconds."""
    return 0 < seconds <= MAX_SECONDS


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


def require_seconds(where: str, name: str, value: object) -> float:
    """``value`` if it is a number of seconds > 0 and at most ``settings.MAX_SECONDS``, else a :class:`ConfigError`
    naming ``name``: NaN would never fire, 0 or less at once, inf or 1e30 overflow a ``timedelta`` or gloo's timeout
    (the same rule as the ``GRADSYNC_*_TIMEOUT`` variables, gradsync/settings.py)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not is_timeout(float(value)):
        raise ConfigError(
            f"{where}: {name} must be a number of seconds > 0 and at most {MAX_SECONDS:.0e}, got "
            f"{type(value).__name__} {value!r:.60}"
        )
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


def require_bool(where: str, name: str, value: object) -> bool:
    """``value`` as a bool if it is one (or 0, 1, a numpy bool), else a :class:`ConfigError` naming ``name``.

    A string is refused rather than taken for its truth: ``shuffle="false"`` from a config file is true in Python.
    """
    # 0 and 1, and numpy's bools, are what torch's own flags take too; a str, None, a float or a list are mistakes.
    integral = isinstance(value, numbers.Integral) and value in (0, 1)
    if not (isinstance(value, bool) or integral or type(value).__name__ == "bool_"):
        raise ConfigError(f"{where}: {name} must be True or False, got {type(value).__name__} {value!r}")
    return bool(value)


def require_group(where: str, name: str, value: object) -> None:
    """A :class:`ConfigError` unless ``value`` is None (the default group) or a ``torch.distributed.ProcessGroup``."""
    import torch.distributed as dist

    if value is not None and not isinstance(value, dist.ProcessGroup):
        raise ConfigError(
            f"{where}: {name} must be a torch.distributed.ProcessGroup (from dist.new_group, or a DeviceMesh's "
            f"get_group()) or None for the default group, got {type(value).__name__} {value!r:.60}"
        )


def require_callable(where: str, name: str, value: object) -> None:
    if not callable(value):
        raise ConfigError(f"{where}: {name} must be callable, got {type(value).__name__} {value!r:.60}")


def require_state(where: str, state: object, keys: tuple[str, ...]) -> dict:
    """A state dict to restore: a mapping holding ``keys``, else a :class:`ConfigError` that says what it got."""
    from collections.abc import Mapping

    if not isinstance(state, Mapping):
        raise ConfigError(
            f"{where}: the state must be a dict from state_dict(), got {type(state).__name__} {state!r:.60}"
        )
    missing = [k for k in keys if k not in state]
    if missing:
        raise ConfigError(
            f"{where}: the state has no {', '.join(repr(k) for k in missing)} (it has {sorted(map(str, state))[:8]}): "
            "it was not saved by this kind of object's state_dict(); load the state saved by the same kind of object."
        )
    return dict(state)


def require_tensors_like(where: str, name: str, saved: object, current: list) -> list:
    """``saved`` if it is a list of tensors shaped as ``current`` (a restored copy of them), else a
    :class:`ConfigError` that names ``name`` and the first mismatch: a state saved over another model."""
    import torch

    if not isinstance(saved, (list, tuple)) or not all(isinstance(t, torch.Tensor) for t in saved):
        raise ConfigError(f"{where}: the state's {name} must be a list of tensors, got {type(saved).__name__}")
    shapes, mine = [tuple(t.shape) for t in saved], [tuple(t.shape) for t in current]
    if shapes != mine:
        first = next((i for i, (a, b) in enumerate(zip(shapes, mine)) if a != b), min(len(shapes), len(mine)))
        raise ConfigError(
            f"{where}: the state's {name} holds {len(shapes)} tensors (#{first}: "
            f"{shapes[first] if first < len(shapes) else 'none'}), this model has {len(mine)} (#{first}: "
            f"{mine[first] if first < len(mine) else 'none'}): it was saved over another model. Load the state "
            "saved over this model."
        )
    return list(saved)
