"""Run a Python module as if only gradsync and one of its extras were installed.

``python with_only_extra.py docs FARM sphinx.cmd.build -E -W ...``: FARM (an empty folder) is filled with links to
the top-level entries of site-packages that belong to the distributions ``pip install gradsync[docs]`` would
install (gradsync's requirements and the extra's, followed transitively), and the module then runs in a fresh
interpreter that sees only FARM, the checkout and the standard library. What a docs host that installs the extra
alone would meet (an integration's trainer missing, say) is met here, without a second venv.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]


def _key(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(extra: str) -> set[str]:
    """The distributions ``pip install gradsync[extra]`` installs, by normalised name (gradsync's own included)."""
    wanted: list[tuple[str, str | None]] = [("gradsync", extra)]
    found: set[str] = set()
    while wanted:
        name, with_extra = wanted.pop()
        if _key(name) in found:
            continue
        found.add(_key(name))
        for text in md.requires(name) or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": with_extra or ""}):
                wanted.extend((req.name, e) for e in (req.extras or {None}))
    return found


def fill(farm: Path, allowed: set[str]) -> None:
    """Links in ``farm`` to each allowed distribution's top-level files and folders (gradsync comes from ROOT)."""
    for dist in md.distributions():
        if _key(dist.metadata["Name"]) not in allowed - {"gradsync"}:
            continue
        base = Path(str(dist.locate_file("")))
        for top in {Path(str(f)).parts[0] for f in dist.files or ()}:
            if top != ".." and (base / top).exists() and not (farm / top).exists():
                (farm / top).symlink_to(base / top)


def main() -> None:
    extra, farm, module, args = sys.argv[1], Path(sys.argv[2]), sys.argv[3], sys.argv[4:]
    fill(farm, closure(extra))
    # -I -S: no site-packages, no user site, no PYTHON* variables; only the farm, the checkout and the stdlib.
    boot = f"import sys, runpy; sys.path[:0] = [{str(farm)!r}, {str(ROOT)!r}]; sys.argv = sys.argv[1:]; "
    boot += f"runpy.run_module({module!r}, run_name='__main__')"
    done = subprocess.run([sys.executable, "-I", "-S", "-c", boot, module, *args], cwd=os.getcwd())
    sys.exit(done.returncode)


if __name__ == "__main__":
    main()
