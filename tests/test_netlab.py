"""The network-namespace lab where the kernel lacks what it needs: lab/netlab.py and the tests that use it say which
feature is missing (namespaces, tbf, netem) and skip, instead of failing. The probe is gradsync doctor's
(gradsync/doctor/kernel.py, tested in tests/test_doctor.py); here it is replaced, so the skip path is tested on a
kernel that has every feature too."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from gradsync.doctor import kernel
from lab import netlab

# tests/conftest.py by its path: a plain `import conftest` finds whichever conftest pytest loaded first (tests/gpu/ has
# one too), so in the whole suite it is not always this folder's.
_spec = importlib.util.spec_from_file_location("tests_conftest", Path(__file__).with_name("conftest.py"))
assert _spec is not None and _spec.loader is not None
conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(conftest)

NO_NETEM = {"namespaces": None, "tbf": None, "netem": "netem is not in this kernel (Error: unknown qdisc)"}


def test_available_names_the_feature_the_links_need(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernel, "features", lambda: NO_NETEM)
    assert netlab.available() is None and netlab.available(rate=False) is None
    assert netlab.available(delay=True) == NO_NETEM["netem"]
    monkeypatch.setattr(kernel, "features", lambda: {**NO_NETEM, "tbf": "tbf is not in this kernel"})
    assert netlab.available() == "tbf is not in this kernel" and netlab.available(rate=False) is None


def test_a_lab_with_a_delay_refuses_naming_netem_before_it_makes_anything(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernel, "features", lambda: NO_NETEM)
    made: list[tuple[str, ...]] = []
    monkeypatch.setattr(netlab, "_sh", lambda *argv, check=True: made.append(argv))
    with pytest.raises(netlab.LabUnavailable, match="delay='5ms': netem is not in this kernel"):
        with netlab.lab(hosts=2, rate="1gbit", delay="5ms", prefix="gsnever"):
            pass
    assert made == []


def _item(marker: pytest.MarkDecorator) -> SimpleNamespace:
    return SimpleNamespace(get_closest_marker=lambda name: marker.mark if name == "netlab" else None)


def test_the_netlab_marker_skips_naming_the_feature(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernel, "features", lambda: NO_NETEM)
    with pytest.raises(pytest.skip.Exception, match="the network-namespace lab: netem is not in this kernel"):
        conftest.pytest_runtest_setup(_item(pytest.mark.netlab(delay=True)))
    conftest.pytest_runtest_setup(_item(pytest.mark.netlab()))  # rate only: tbf is here, no skip
    monkeypatch.setattr(kernel, "features", lambda: {n: f"{n}: cannot create a network namespace" for n in NO_NETEM})
    with pytest.raises(pytest.skip.Exception, match="namespaces: cannot create"):
        conftest.pytest_runtest_setup(_item(pytest.mark.netlab(rate=False)))


def _qdiscs(host: netlab.Host) -> str:
    return subprocess.run(
        host.command(["tc", "qdisc", "show", "dev", host.interface]), capture_output=True, text=True
    ).stdout


@pytest.mark.netlab(rate=False)
def test_a_lab_without_shaping_needs_only_namespaces() -> None:
    with netlab.lab(hosts=2, rate=None, prefix="gsnetlab") as hosts:
        assert "tbf" not in _qdiscs(hosts[0]) and "netem" not in _qdiscs(hosts[0])
        shown = subprocess.run(hosts[1].command(["ip", "addr", "show", "eth0"]), capture_output=True, text=True)
        assert hosts[1].address in shown.stdout


@pytest.mark.netlab(delay=True)
def test_a_delayed_link_is_shaped_by_netem_then_tbf() -> None:
    with netlab.lab(hosts=2, rate="100mbit", delay="5ms", prefix="gsnetlab") as hosts:
        shown = _qdiscs(hosts[0])
        assert "netem" in shown and "delay 5ms" in shown and "tbf" in shown, shown
