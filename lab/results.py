"""The one writer of result files: every JSON a lab or a conformance suite writes says which command made it, from
which commit, and whether the tree had uncommitted changes, so a figure can be traced back and rerun.

    from lab.results import write_json
    write_json("bench/results/latest.json", result)   # result | {"provenance": {...}}
"""

from __future__ import annotations

import functools
import json
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def command_line(argv: list[str] | None = None) -> str:
    """This process's command as one would type it: ``python -m bench.scale --link 1gbit`` for a module run with
    ``-m`` (``sys.argv[0]`` is then the module's file), else ``python SCRIPT ARGS``."""
    argv = list(sys.argv if argv is None else argv)
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name:
        module = spec.name.removesuffix(".__main__")
        return shlex.join(["python", "-m", module, *argv[1:]])
    return shlex.join(["python", *argv])


@functools.cache
def commit() -> dict[str, Any]:
    """``{"commit": HEAD's hash, "dirty": True if tracked files differ from it}``; None for both outside a git
    checkout (or without git)."""
    try:
        head = _git("rev-parse", "HEAD")
        dirty = bool(_git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None, "dirty": None}
    return {"commit": head, "dirty": dirty}


def _git(*args: str) -> str:
    # safe.directory: lab processes run as root inside namespaces, on a checkout root may not own.
    argv = ["git", "-c", f"safe.directory={ROOT}", "-C", str(ROOT), *args]
    return subprocess.run(argv, check=True, capture_output=True, text=True, timeout=30).stdout.strip()


def provenance(argv: list[str] | None = None) -> dict[str, Any]:
    """What made a result: the command line (as typed, and ``sys.argv`` verbatim) and the commit."""
    return {"command": command_line(argv), "argv": list(sys.argv if argv is None else argv), **commit()}


def write_json(
    path: str | Path, data: dict[str, Any], indent: int | None = 1, made_by: dict[str, Any] | None = None
) -> Path:
    """Write ``data`` and this process's :func:`provenance` (under ``"provenance"``) to ``path`` as JSON, creating
    its folder; returns the path. ``made_by``: another provenance to record instead, for a file rewritten from
    results an earlier command made (a report refreshed, nothing rerun)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**data, "provenance": made_by or provenance()}, indent=indent) + "\n")
    return path


def read_json(path: str | Path) -> dict[str, Any]:
    """A result file's data, without its provenance (what a summary built from several runs reads)."""
    data = json.loads(Path(path).read_text())
    data.pop("provenance", None)
    return data
