"""Python, gradsync's own version, torch against the supported floor, and the torch-private names gradsync relies
on (through :mod:`gradsync.torch_private`, which records them)."""

from __future__ import annotations

import importlib.metadata
import re
import sys
from pathlib import Path

import torch

import gradsync
from gradsync.doctor.result import Result, Status
from gradsync.torch_private import CHECKED_VERSIONS, FLOOR, PRIVATE_NAMES, PUBLIC_APIS, missing

PYTHON_FLOOR = (3, 10)  # pyproject's requires-python


def _release(version: str) -> tuple[int, ...]:
    """``"2.13.0+cpu"`` -> (2, 13, 0): the release numbers, without a local or pre-release part."""
    match = re.match(r"\d+(\.\d+)*", version)
    return tuple(int(p) for p in match.group(0).split(".")) if match else ()


def check_python() -> Result:
    found = ".".join(str(p) for p in sys.version_info[:3])
    if sys.version_info[:2] < PYTHON_FLOOR:
        floor = ".".join(map(str, PYTHON_FLOOR))
        return Result("python", "fail", f"Python {found}; gradsync needs {floor} or later", f"use Python {floor}+")
    return Result("python", "ok", f"Python {found} ({sys.executable})")


def check_gradsync() -> Result:
    """gradsync's version, and that the installed distribution says the same (an editable install whose metadata
    predates a version change says the old one until it is reinstalled)."""
    ours = gradsync.__version__
    try:
        installed = importlib.metadata.version("gradsync")
    except importlib.metadata.PackageNotFoundError:
        return Result(
            "gradsync", "warn", f"gradsync {ours}, not installed as a distribution", "pip install gradsync (or -e .)"
        )
    if installed != ours:
        return Result(
            "gradsync",
            "warn",
            f"gradsync {ours} imported, but the installed distribution says {installed}",
            "reinstall it (pip install -e . in a checkout), so that tools reading the metadata agree",
        )
    return Result("gradsync", "ok", f"gradsync {ours} (from {Path(gradsync.__file__).parent})")


def check_torch() -> Result:
    """torch against pyproject's floor and the newest release gradsync was checked against."""
    found, newest = torch.__version__, CHECKED_VERSIONS[-1]
    if _release(found) < _release(FLOOR):
        return Result(
            "torch", "fail", f"torch {found}; gradsync needs {FLOOR} or later", f"pip install 'torch>={FLOOR}'"
        )
    if _release(found)[:2] > _release(newest)[:2]:
        return Result(
            "torch",
            "warn",
            f"torch {found} is newer than the newest checked ({CHECKED_VERSIONS[0]} to {newest})",
            "see 'torch private names' for what it lacks; report anything that breaks",
        )
    return Result("torch", "ok", f"torch {found} (checked: {CHECKED_VERSIONS[0]} to {newest})")


def check_private_names() -> Result:
    """Every torch name and behaviour gradsync relies on resolves; a missing one with a fallback is a warning."""
    name = "torch private names"
    gaps = missing("*")  # every record, public APIs included; imports torch._dynamo (a slow import)
    total = len(PRIVATE_NAMES) + len(PUBLIC_APIS)
    if not gaps:
        return Result(
            name, "ok", f"all {total} names and behaviours gradsync relies on are in torch {torch.__version__}"
        )
    fallbacks = {r.name: r.fallback for r in PRIVATE_NAMES} | {r.name: r.fallback for r in PUBLIC_APIS}
    said = [f"{g} (gradsync falls back: {fallbacks[g]})" if fallbacks.get(g) else f"{g} (needed)" for g in gaps]
    status: Status = "warn" if all(fallbacks.get(g) for g in gaps) else "fail"
    fix = f"install a checked torch ({CHECKED_VERSIONS[0]} to {CHECKED_VERSIONS[-1]})"
    return Result(name, status, f"this torch lacks {len(gaps)} of {total}: " + "; ".join(said), fix)
