"""The surface the generated sweep covers, read from the code rather than listed by hand: every public callable's
parameters (the public packages' ``__all__``), every ``gradsync run`` / ``gradsync doctor`` flag (their parser),
every ``--rdzv-conf`` key, every ``GRADSYNC_*`` variable named in gradsync's source, and every public class whose
state is restored from a checkpoint (it has ``load_state_dict``).

A name added to any of these is found here, so the coverage test (tests/test_generated_sweep.py) fails until the
domain table (domains.py) says how to call it validly and which values are wrong for it.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from conformance.sweep.core import ROOT
from lab.public import PUBLIC

_VARIABLE = re.compile(r"""["'](GRADSYNC_[A-Z0-9_]*[A-Z0-9])["']""")


def public_names(module: Any) -> list[str]:
    """``__all__``, or, for a module without one, the classes and functions it defines without a leading ``_``
    (the rule of tests/test_docs.py)."""
    if hasattr(module, "__all__"):
        return list(module.__all__)
    return [
        n
        for n, v in vars(module).items()
        if not n.startswith("_") and (inspect.isclass(v) or inspect.isfunction(v)) and v.__module__ == module.__name__
    ]


def public_callables() -> dict[str, Callable[..., Any]]:
    """Qualified name -> object, for every public function and class but exceptions, first path wins (the same object
    re-exported under another public path is one entry)."""
    found: dict[str, Callable[..., Any]] = {}
    seen: set[int] = set()
    for package in PUBLIC:
        try:
            module = importlib.import_module(package)
        except ImportError:  # an optional integration whose library is not installed
            continue
        for name in public_names(module):
            obj = getattr(module, name)
            if not callable(obj) or (inspect.isclass(obj) and issubclass(obj, BaseException)) or id(obj) in seen:
                continue
            seen.add(id(obj))
            found[f"{package}.{name}"] = obj
    return found


def unavailable() -> list[str]:
    """The public packages that cannot be imported here (an optional integration whose library is missing)."""
    missing = []
    for package in PUBLIC:
        try:
            importlib.import_module(package)
        except ImportError:
            missing.append(package)
    return missing


def parameters(obj: Callable[..., Any]) -> list[inspect.Parameter]:
    """The named parameters a user passes (not ``self``, ``*args``, ``**kwargs``, nor a dataclass's private fields)."""
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return []
    kinds = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return [p for p in signature.parameters.values() if p.kind not in kinds and not p.name.startswith("_")]


def restored_classes() -> dict[str, type]:
    """Public classes whose state comes back from a checkpoint (``load_state_dict``)."""
    return {n: o for n, o in public_callables().items() if inspect.isclass(o) and hasattr(o, "load_state_dict")}


def _actions(p: argparse.ArgumentParser) -> Iterator[argparse.Action]:
    for action in p._actions:
        if action.option_strings and not isinstance(action, argparse._HelpAction):
            yield action


def run_flags() -> dict[str, argparse.Action]:
    """``gradsync run``'s flags, dest -> action (torchrun's and gradsync's own)."""
    from gradsync.runtime import run_flags as flags

    return {a.dest: a for a in _actions(flags.parser())}


def doctor_flags() -> dict[str, argparse.Action]:
    """``gradsync doctor``'s flags: run's, without the script, plus ``--json``."""
    from gradsync.runtime import run_flags as flags

    p = flags.parser(prog="gradsync doctor", script=False)
    p.add_argument("--json", action="store_true")
    return {a.dest: a for a in _actions(p)}


def rdzv_conf_keys() -> list[str]:
    """Every key ``--rdzv-conf`` takes with ``--store etcd://``, torch's etcd-v2 spellings included."""
    from gradsync.runtime import etcd_access

    return [*etcd_access.KEYS, *etcd_access.ALIASES]


def environment_variables() -> list[str]:
    """Every ``GRADSYNC_*`` variable named as a whole string in gradsync's source."""
    names: set[str] = set()
    for path in sorted((ROOT / "gradsync").rglob("*.py")):
        names.update(_VARIABLE.findall(Path(path).read_text()))
    return sorted(names)
