"""The bad-input sweep generated from the surface (conformance/sweep/generated/, issue 58).

The coverage tests need no run: every public callable, parameter, restored class, command-line flag, --rdzv-conf
key and GRADSYNC_* variable the code has must have an entry in the sweep's tables (a domain, a valid baseline
call, the wrong values), so a new one is swept without a test being written for it, and fails here until it has.
The fast form runs the cases of this slice's surfaces (comm, optim, data, nn, checkpoint, settings) and every
valid baseline, in one subprocess (a forked child per case): each wrong value must end in a clear error, each
baseline be accepted. ``python -m conformance.sweep.generated`` runs everything, the other surfaces included.
"""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

from conformance.sweep.generated import api, commands, restore, surface

ROOT = Path(__file__).parents[1]


def test_every_public_callable_and_parameter_has_a_table_entry() -> None:
    missing, stale = [], []
    callables = surface.public_callables()
    for name, obj in callables.items():
        if name in api.UNSWEPT:
            continue
        target = api.TABLE.get(name)
        if target is None:
            missing.append(f"{name} (add it to api.TABLE with a valid baseline call, or to UNSWEPT with why)")
            continue
        params = {p.name for p in surface.parameters(obj)}
        missing += [f"{name}({p}=...) (add its domain)" for p in sorted(params - set(target.params))]
        stale += [f"{name}({p}=...)" for p in sorted(set(target.params) - params)]
    absent = tuple(f"{package}." for package in surface.unavailable())  # not importable here: not stale
    public = {id(obj) for obj in callables.values()}  # an alias (ZeroRedundancyOptimizer) is the same object
    stale += [
        name
        for name in {*api.TABLE, *api.UNSWEPT}
        if name not in callables and not name.startswith(absent) and id(_resolved(name)) not in public
    ]
    assert not missing, f"public names the generated sweep does not cover: {missing}"
    assert not stale, f"table entries for names that are no longer public: {stale}"


def _resolved(name: str) -> object:
    try:
        return pkgutil.resolve_name(name)
    except (ImportError, AttributeError):
        return None


def test_every_restored_class_has_wrong_states() -> None:
    missing = sorted(set(surface.restored_classes()) - set(restore.RESTORED))
    assert not missing, f"public classes with load_state_dict and no entry in restore.RESTORED: {missing}"


def test_every_flag_key_and_variable_has_wrong_values_or_a_reason() -> None:
    missing = []
    for command, flags in (("run", surface.run_flags()), ("doctor", surface.doctor_flags())):
        for action in flags.values():
            try:
                commands.flag_values(action)
            except KeyError:
                missing.append(f"gradsync {command} {action.option_strings[0]} (add it to commands.FLAGS)")
    missing += [f"--rdzv-conf {k}=" for k in surface.rdzv_conf_keys() if k not in commands.RDZV_CONF]
    missing += [v for v in surface.environment_variables() if v not in commands.VARIABLES]
    assert not missing, f"not covered by the generated sweep: {missing}"


@pytest.mark.long
def test_this_slices_surfaces_refuse_every_wrong_value_clearly(tmp_path: Path) -> None:
    """Wrong values on comm, optim, data, nn, checkpoint and settings: each a clear error when given; each valid
    baseline (of every surface) accepted. Other surfaces' findings are the full run's (conformance/results/)."""
    cases, bad = _swept(tmp_path, "mine,(baseline)")
    assert len(cases) > 300
    assert not bad, "\n".join(bad)


@pytest.mark.long
def test_the_cli_elastic_observe_and_integrations_refuse_every_wrong_value_clearly(tmp_path: Path) -> None:
    """Every gradsync run / doctor flag, --rdzv-conf key, and elastic, observe, runtime and integrations argument:
    each wrong value a clear error when given (one line and exit 2 for a command)."""
    cases, bad = _swept(tmp_path, "cli,elastic,observe,runtime,integrations")
    assert len(cases) > 250
    assert not bad, "\n".join(bad)


def _swept(tmp_path: Path, select: str) -> tuple[list[dict], list[str]]:
    """The generated sweep's cases selected by ``select`` (its -k), and those neither clear nor accepted."""
    out = tmp_path / "sweep.json"
    argv = [sys.executable, "-m", "conformance.sweep.generated", "-k", select, "--out", str(out)]
    subprocess.run(argv, cwd=ROOT, check=True, timeout=900, stdout=subprocess.DEVNULL)
    cases = json.loads(out.read_text())["cases"]
    bad = [f"[{c['class']}] {c['name']}: {'; '.join(c.get('problems', []))} {c['message'][:300]}"
           for c in cases if c["class"] not in ("clear", "accepted")]  # fmt: skip
    return cases, bad
