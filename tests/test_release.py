"""What a packager checks: the wheel carries every module, the license and the typing marker, its metadata says
what pyproject.toml says; every public path imports as the module the docs call it; the changelog names this
version; the docs site builds from the ``docs`` extra alone. CI also installs the built wheel in a clean venv and
runs the main job and a part of this suite against it (.ci/release-check); ``test_imported_from`` says which copy
of gradsync those runs tested."""

from __future__ import annotations

import email
import importlib.util
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from docs_blocks import PUBLIC

import gradsync

ROOT = Path(__file__).parents[1]
SCRIPTS = Path(__file__).parent / "scripts"
# Set by .ci/release-check, which runs this file against the installed wheel, from outside the checkout.
INSTALLED = os.environ.get("GRADSYNC_TEST_INSTALLED") == "1"


def test_imported_from_the_copy_under_test() -> None:
    """Under .ci/release-check, gradsync is the installed wheel's, not a checkout's; otherwise it is this checkout's
    (editable), so a test run never silently tests another copy."""
    where = Path(gradsync.__file__).resolve()
    if INSTALLED:
        assert "site-packages" in where.parts and not where.is_relative_to(ROOT), where
    else:
        assert where.is_relative_to(ROOT), where


def test_every_public_path_imports_as_a_module() -> None:
    """``from gradsync.checkpoint import save`` works in a fresh interpreter, as the API reference documents it,
    for every public path (an attribute bound in a package's __init__ is not importable as a module)."""
    # An integration's module needs its trainer (its extra); the installed wheel's venv has the examples extra only.
    usable = [
        n for n in PUBLIC if not n.startswith("gradsync.integrations.") or importlib.util.find_spec(n.split(".")[2])
    ]
    assert INSTALLED or usable == PUBLIC, "the test venv has every extra: README's test command installs them"
    code = "import importlib\n" + "".join(f"importlib.import_module({name!r})\n" for name in usable)
    code += "from gradsync.checkpoint import save, load, restore\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_changelog_names_this_version() -> None:
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert f"\n## {gradsync.__version__} (" in changelog, f"CHANGELOG.md has no '## {gradsync.__version__} (date)'"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel built from this checkout, as CI builds it (an isolated build: setuptools from pyproject)."""
    if INSTALLED:
        pytest.skip("under .ci/release-check the wheel was built and checked before it was installed")
    out = tmp_path_factory.mktemp("dist")
    done = subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--outdir", str(out), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (built,) = out.glob("gradsync-*.whl")
    return built


def test_the_wheel_carries_every_module_the_license_and_py_typed(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "gradsync").rglob("*.py")}
    assert modules - names == set(), f"modules missing from {wheel.name}"
    assert "gradsync/py.typed" in names
    dist_info = f"gradsync-{gradsync.__version__}.dist-info"
    assert f"{dist_info}/licenses/LICENSE" in names, sorted(n for n in names if "dist-info" in n)
    licensed = zipfile.ZipFile(wheel).read(f"{dist_info}/licenses/LICENSE").decode()
    assert licensed == (ROOT / "LICENSE").read_text()


def test_the_wheels_metadata_is_pyprojects(wheel: Path) -> None:
    dist_info = f"gradsync-{gradsync.__version__}.dist-info"
    meta = email.message_from_bytes(zipfile.ZipFile(wheel).read(f"{dist_info}/METADATA"))
    assert meta["Version"] == gradsync.__version__
    assert meta["License-Expression"] == "BSD-3-Clause"
    assert meta["Requires-Python"] == ">=3.10"
    requires = meta.get_all("Requires-Dist") or []
    assert "torch>=2.4" in requires, requires
    entry = zipfile.ZipFile(wheel).read(f"{dist_info}/entry_points.txt").decode()
    assert re.search(r"^gradsync = gradsync\.cli:main$", entry, re.M), entry
    done = subprocess.run(
        [sys.executable, "-m", "twine", "check", "--strict", str(wheel)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.long
@pytest.mark.timeout(300)
def test_the_site_builds_from_the_docs_extra_alone(tmp_path: Path) -> None:
    """docs/index.md's build, with only what ``pip install gradsync[docs]`` installs importable (as on a docs host:
    no Lightning, no Accelerate): no warning, and every documented name on its page, the integrations' included."""
    if INSTALLED:
        pytest.skip("the docs build from the checkout's docs/; the installed wheel has none")
    from test_docs import documented  # collecting test_docs needs every extra, which the wheel's venv lacks

    farm, html = tmp_path / "site-packages", tmp_path / "html"
    farm.mkdir()
    command = [sys.executable, str(SCRIPTS / "with_only_extra.py"), "docs", str(farm), "sphinx.cmd.build"]
    command += ["-E", "-W", "--keep-going", "-b", "html", "docs", str(html)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0 and "WARNING" not in done.stderr, done.stdout[-2000:] + done.stderr[-6000:]
    assert not (farm / "lightning").exists() and not (farm / "accelerate").exists(), "the extra alone has neither"
    for d in documented():
        page = (html / d.page.removeprefix("docs/")).with_suffix(".html").read_text()
        target = f"module-{d.name}" if d.directive == "automodule" else d.name
        assert f'id="{target}"' in page, f"{d.page}: {d.name} is not on the page built from the docs extra"
    integrations = (html / "api" / "integrations.html").read_text()
    assert "monitor" in re.sub(r"<[^>]+>", "", integrations), "GradsyncStrategy's own signature (monitor=...)"
