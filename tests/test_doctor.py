"""``gradsync doctor`` and ``gradsync --version``: each check's verdict on this machine and on the situations it
exists to catch (a wrong GLOO_SOCKET_IFNAME, a host name that resolves to loopback, a store that does not answer, a
kernel without netem), made on loopback only, with fake interfaces, members and commands where the real ones would
be another machine's."""

from __future__ import annotations

import http.server
import importlib.metadata
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from fake_etcd import FakeEtcdMember

import gradsync
from gradsync import cli
from gradsync.doctor import backends, kernel, network, report, store, torch_checks
from gradsync.doctor.job import Job, check_flags, parse
from gradsync.doctor.network import Interface

ROOT = Path(__file__).parents[1]


def _gradsync(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gradsync", *args], capture_output=True, text=True, timeout=120)


# ------------------------------------------------------------------------------------------------ --version
def test_version_is_gradsyncs_and_the_distributions(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out == f"gradsync {gradsync.__version__}\n"
    assert importlib.metadata.version("gradsync") == gradsync.__version__
    assert "gradsync --version" in cli.USAGE and "doctor" in cli.USAGE


def test_python_m_gradsync_version() -> None:
    done = _gradsync("--version")
    assert done.returncode == 0 and done.stdout == f"gradsync {gradsync.__version__}\n", done.stderr


def test_pyproject_takes_its_version_from_the_package() -> None:
    """One version, written once: setuptools reads gradsync.__version__, so the wheel's metadata cannot differ."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in config["project"] and "version" in config["project"]["dynamic"]
    assert config["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "gradsync.__version__"}


# ------------------------------------------------------------------------------------------------ the command
def test_doctor_json_on_this_machine() -> None:
    """Every check reports, in the documented schema; nothing stops a one-node job here (exit status 0)."""
    done = _gradsync("doctor", "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    rows = json.loads(done.stdout)
    assert all(set(r) == {"name", "status", "detail", "fix", "optional"} for r in rows), rows
    assert all(r["status"] in ("ok", "warn", "fail", "skip") for r in rows), rows
    names = [r["name"] for r in rows]
    for name in ("python", "torch", "torch private names", "gloo", "nccl/GPUs", "network", "rendezvous store"):
        assert name in names, names
    assert [r["optional"] for r in rows if r["name"].startswith("lab: ")] == [True, True, True]


def test_doctor_table_and_exit_status_1_for_a_job_that_would_fail(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["doctor", "--nnodes", "0"]) == 1
    out = capsys.readouterr().out
    assert "gradsync doctor" in out and "would fail" in out and "--nnodes 0" in out, out


def test_a_missing_lab_feature_never_fails_a_job(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernel, "features", lambda: {"namespaces": None, "tbf": None, "netem": "netem is absent"})
    rows = kernel.check_lab()
    assert [r.status for r in rows] == ["ok", "ok", "warn"] and all(r.optional for r in rows)
    assert not report.fails_a_job(rows)


# ------------------------------------------------------------------------------------------------ flags
def test_flags_give_the_store_gradsync_run_would_use() -> None:
    assert parse([])[0].endpoint is None  # one node: a free port
    assert parse(["--nnodes", "2", "--master-addr", "node0"])[0].endpoint == "node0:29500"
    assert parse(["--nnodes", "2", "--rdzv-endpoint", "node0:29400"])[0].endpoint == "node0:29400"
    assert parse(["--rdzv_backend", "c10d", "--nnodes", "2"])[0].endpoint == "localhost:29400"
    assert parse(["--standalone", "--nnodes", "2"])[0].endpoint is None
    job, as_json = parse(["--json", "--nproc-per-node", "2", "train.py", "--lr", "3"], environ={})
    assert as_json and job.workers_per_node == "2" and job.ignored == ("train.py", "--lr", "3")
    assert job.gloo_ifname is None and parse([], environ={"GLOO_SOCKET_IFNAME": "eth1"})[0].gloo_ifname == "eth1"


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--nnodes", "3:2"], "--nnodes 3:2"),
        (["--nproc-per-node", "two"], "--nproc-per-node two"),
        (["--store", "etcd://node0:2379"], "add --elastic"),
        (["--elastic", "--store", "etcd://node0:2379"], "--rdzv-id"),
    ],
)
def test_flags_gradsync_run_refuses_fail(argv: list[str], words: str) -> None:
    result = check_flags(parse(argv)[0])
    assert result.status == "fail" and words in result.detail, result


# ------------------------------------------------------------------------------------------------ torch
def test_torch_below_the_floor_fails_and_above_the_checked_warns(monkeypatch: pytest.MonkeyPatch) -> None:
    assert torch_checks.check_torch().status == "ok"
    monkeypatch.setattr(torch, "__version__", "2.3.1")
    assert torch_checks.check_torch().status == "fail"
    monkeypatch.setattr(torch, "__version__", "2.99.0+cu130")
    assert torch_checks.check_torch().status == "warn"


def test_a_lacking_torch_name_fails_unless_gradsync_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    assert torch_checks.check_private_names().status == "ok"
    with_fallback = "torch._foreach_copy_"  # gradsync copies one tensor at a time instead
    monkeypatch.setattr(torch_checks, "missing", lambda seam: [with_fallback])
    assert torch_checks.check_private_names().status == "warn"
    monkeypatch.setattr(torch_checks, "missing", lambda seam: [with_fallback, "torch._C._some_new_name"])
    result = torch_checks.check_private_names()
    assert result.status == "fail" and "torch._C._some_new_name (needed)" in result.detail


def test_stale_installed_metadata_is_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    assert torch_checks.check_gradsync().status == "ok"
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.0.1")
    result = torch_checks.check_gradsync()
    assert result.status == "warn" and "0.0.1" in result.detail


# ------------------------------------------------------------------------------------------------ backends
def test_gloo_forms_a_group_of_one_and_names_a_missing_interface(monkeypatch: pytest.MonkeyPatch) -> None:
    assert backends.check_gloo().status == "ok"
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "gsnosuch0")
    result = backends.check_gloo()
    assert result.status == "fail" and "gsnosuch0" in result.detail, result


def test_no_gpu_is_fine_unless_the_flags_ask_for_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert backends.check_gpus(Job()).detail == "no GPU: CPU/gloo only"
    assert backends.check_gpus(Job(workers_per_node="gpu")).status == "fail"


def test_nccl_refuses_more_workers_than_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "NVIDIA H200")
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 27, 3))
    assert backends.check_gpus(Job(workers_per_node="2")).detail == "NCCL 2.27.3; 2 GPU(s): NVIDIA H200"
    assert backends.check_gpus(Job(workers_per_node="4")).status == "fail"
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: False)
    assert backends.check_gpus(Job(workers_per_node="2")).status == "fail"


# ------------------------------------------------------------------------------------------------ network
HOST = [Interface("lo", True, ("127.0.0.1",)), Interface("eth0", True, ("192.0.2.2",)), Interface("eth1", False, ())]


@pytest.mark.parametrize(
    "ifname, status, words",
    [
        ("eth0", "ok", "gloo binds eth0 (192.0.2.2)"),
        ("eth7", "fail", "no interface eth7"),
        ("eth1", "fail", "eth1 is down"),
        ("lo", "warn", "the other hosts cannot reach this one"),
    ],
)
def test_the_interface_gloo_is_told_to_use(
    monkeypatch: pytest.MonkeyPatch, ifname: str, status: str, words: str
) -> None:
    monkeypatch.setattr(network, "interfaces", lambda: HOST)
    result = network.check_interface(Job(nnodes="2", endpoint="node0:29400", gloo_ifname=ifname))
    assert result.status == status and words in result.detail, result


def test_loopback_is_fine_when_every_node_is_on_this_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(network, "interfaces", lambda: HOST)
    assert network.check_interface(Job(nnodes="1", gloo_ifname="lo")).status == "ok"
    assert network.check_interface(Job(nnodes="2", endpoint="localhost:29400", gloo_ifname="lo")).status == "ok"


def test_a_host_name_that_resolves_to_loopback_warns_a_multi_host_job(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(network, "interfaces", lambda: HOST)
    monkeypatch.setattr(socket, "gethostname", lambda: "box")
    monkeypatch.setattr(network, "resolve", lambda host: ["127.0.1.1"])
    result = network.check_interface(Job(nnodes="1:4", endpoint="node0:29400"))
    assert result.status == "warn" and "box resolves to 127.0.1.1" in result.detail, result
    assert "GLOO_SOCKET_IFNAME" in result.fix and "eth0 192.0.2.2" in result.fix, result
    monkeypatch.setattr(network, "resolve", lambda host: ["192.0.2.2"])
    assert network.check_interface(Job(nnodes="4", endpoint="node0:29400")).status == "ok"


def test_this_machines_interfaces_are_read() -> None:
    found = {i.name: i for i in network.interfaces()}
    assert found["lo"].up and found["lo"].loopback and "127.0.0.1" in found["lo"].addresses, found


def test_a_name_lookup_is_bounded() -> None:
    assert "127.0.0.1" in (network.resolve("localhost") or [])
    assert network.resolve("gsdoctor.invalid") == []  # RFC 2606: never resolves


# ------------------------------------------------------------------------------------------------ the store
@pytest.fixture
def listening() -> Iterator[socket.socket]:
    """A TCP server on 127.0.0.2, a loopback address that is none of this host's interface addresses: doctor
    treats it as another host's store."""
    server = socket.socket()
    server.bind(("127.0.0.2", 0))
    server.listen()
    yield server
    server.close()


def test_another_hosts_store_answers_or_refuses(listening: socket.socket) -> None:
    port = listening.getsockname()[1]
    result = store.check_rendezvous(Job(nnodes="2", endpoint=f"127.0.0.2:{port}"))
    assert result.status == "ok" and "answers" in result.detail, result
    listening.close()
    result = store.check_rendezvous(Job(nnodes="2", endpoint=f"127.0.0.2:{port}"))
    assert result.status == "warn" and "refused" in result.detail, result


def test_a_store_this_node_serves_needs_its_port_free() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = store.check_rendezvous(Job(nnodes="2", endpoint=f"localhost:{port}"))
        assert result.status == "fail" and f"port {port} cannot be bound" in result.detail, result
    assert store.check_rendezvous(Job(nnodes="2", endpoint=f"localhost:{port}")).status == "ok"
    unresolved = store.check_rendezvous(Job(nnodes="2", endpoint="gsdoctor.invalid:29400"))
    assert unresolved.status == "fail" and "does not resolve" in unresolved.detail


@pytest.fixture
def members() -> Iterator[list[str]]:
    """Two fake etcd members on loopback, and a third endpoint where nothing listens."""
    servers = [http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeEtcdMember) for _ in range(2)]
    for s in servers:
        threading.Thread(target=s.serve_forever, daemon=True).start()
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        nobody = free.getsockname()[1]
    yield [f"127.0.0.1:{s.server_address[1]}" for s in servers] + [f"127.0.0.1:{nobody}"]
    for s in servers:
        s.shutdown()
        s.server_close()


def test_etcd_members_answer_through_the_jobs_client(members: list[str]) -> None:
    def check(endpoints: list[str]) -> tuple[str, str]:
        result = store.check_etcd(Job(store="etcd://" + ",".join(endpoints), elastic=True, job_name="job"))
        return result.status, result.detail

    status, detail = check(members[:2])
    leader = FakeEtcdMember.leader
    assert status == "ok" and detail == "; ".join(f"{m}: etcd 3.4.30, leader {leader}" for m in members[:2])
    status, detail = check(members)
    assert status == "warn" and f"{members[2]}: refused the connection" in detail and "a majority" in detail
    assert check([members[0], members[2], members[2].replace("127.0.0.1", "127.0.0.3")])[0] == "fail"
    assert store.check_etcd(Job()).status == "skip"


# ------------------------------------------------------------------------------------------------ the lab's kernel
def _fake_commands(folder: Path, ip: str, tc: str) -> str:
    """A PATH on which ``ip`` and ``tc`` are these shell scripts' bodies."""
    folder.mkdir()
    for name, body in (("ip", ip), ("tc", tc)):
        (folder / name).write_text(f"#!/bin/sh\n{body}\n")
        (folder / name).chmod(0o755)
    return f"{folder}{os.pathsep}{os.environ['PATH']}"


def test_the_probe_names_netem_where_the_kernel_lacks_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    no_netem = 'case "$*" in *netem*) echo "Error: Specified qdisc kind is unknown." >&2; exit 2;; esac'
    monkeypatch.setenv("PATH", _fake_commands(tmp_path / "bin", ip="exit 0", tc=no_netem))
    found = kernel.probe()
    assert found["namespaces"] is None and found["tbf"] is None, found
    assert found["netem"] == "netem is not in this kernel (Error: Specified qdisc kind is unknown.)"


def test_the_probe_names_namespaces_where_they_cannot_be_made(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    not_root = 'echo "mount --make-shared /run/netns failed: Operation not permitted" >&2; exit 1'
    monkeypatch.setenv("PATH", _fake_commands(tmp_path / "bin", ip=not_root, tc="exit 0"))
    found = kernel.probe()
    assert found["namespaces"] is not None and found["namespaces"].startswith("namespaces: cannot create")
    assert found["tbf"] == "tbf: not probed (no namespace)" and found["netem"] == "netem: not probed (no namespace)"


def test_the_probe_on_this_machine_names_each_feature_and_leaves_nothing() -> None:
    found = kernel.probe()
    assert set(found) == {"namespaces", "tbf", "netem"}
    assert all(why is None or why.startswith(name) for name, why in found.items()), found
    if found["namespaces"] is None:
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert f"gsdoctor-{os.getpid()}-" not in listed, listed


# ------------------------------------------------------------------------------------------------ docs/doctor.md
def _docs_lines(section: str, index: int = 0) -> list[str]:
    from docs_blocks import block

    return [line for line in block("docs/doctor.md", "bash", section, index).splitlines() if line.strip()]


def _doctor_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "GLOO_SOCKET_IFNAME"}
    return env | {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}", **extra}


def test_the_docs_commands_run_as_written(tmp_path: Path) -> None:
    """docs/doctor.md's one-machine command, as written: nothing stops the job here (exit status 0)."""
    line = _docs_lines("Will this work here?")[0]
    assert line.startswith("gradsync doctor --nproc-per-node 2 "), line
    done = subprocess.run(["bash", "-c", line], cwd=tmp_path, env=_doctor_env(), capture_output=True, text=True)
    assert done.returncode == 0 and "gradsync doctor" in done.stdout, done.stdout + done.stderr


@pytest.mark.long
@pytest.mark.netlab()
@pytest.mark.timeout(120)
def test_the_docs_commands_for_two_hosts_run_as_written(tmp_path: Path) -> None:
    """docs/doctor.md's host A and host B commands, as written, on two namespace hosts at their addresses (10.0.0.1
    and .2, inside the namespaces only), each with GLOO_SOCKET_IFNAME=eth0: host A serves the store on a free port;
    host B finds nothing serving it yet, a warning."""
    from lab import netlab

    lines = _docs_lines("Will this work here?")[1:]
    with netlab.lab(hosts=2, rate="1gbit", prefix="gsdocdr", subnet="10.0.0") as hosts:
        outputs = []
        for host, line in zip(hosts, lines):
            assert f"--local-addr {host.address} " in line, (host.address, line)
            env = _doctor_env(GLOO_SOCKET_IFNAME=host.interface, COLUMNS="200")
            command = host.command(["env", *[f"{k}={v}" for k, v in env.items()], "bash", "-c", line])
            done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=100)
            assert done.returncode == 0, done.stdout + done.stderr
            outputs.append(done.stdout)
    assert "this node serves the store at 10.0.0.1:29400 (the port is free)" in outputs[0], outputs[0]
    assert "10.0.0.1:29400 refused the connection" in outputs[1], outputs[1]


def test_the_docs_json_block_runs_as_written(tmp_path: Path) -> None:
    """docs/doctor.md's --json block: the names of the failing checks, none here."""
    from docs_blocks import block

    code = block("docs/doctor.md", "bash", "Machine-readable", count=1)
    done = subprocess.run(["bash", "-c", code], cwd=tmp_path, env=_doctor_env(), capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout == "[]\n", done.stdout + done.stderr
    assert {c["name"] for c in json.loads((tmp_path / "doctor.json").read_text())} >= {"gloo", "network"}


def test_a_slow_reverse_lookup_warns_naming_the_address(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's TCPStore looks up every peer by address (its server on its one thread): a resolver that does not
    answer stalls the job's store at each connection (docs/scaling.md)."""
    from gradsync.doctor import reverse_lookup

    def getnameinfo(sockaddr: tuple, flags: int) -> tuple[str, str]:
        if sockaddr[0] == "10.9.9.9":
            time.sleep(0.4)  # past LOOKUP_S below: unanswered
        return sockaddr[0], "0"

    monkeypatch.setattr(reverse_lookup.socket, "getnameinfo", getnameinfo)
    monkeypatch.setattr(reverse_lookup, "LOOKUP_S", 0.2)
    monkeypatch.setattr(reverse_lookup, "resolve", lambda host: ["10.9.9.9"] if host == "node0" else [])
    result = reverse_lookup.check_reverse_lookup(Job(nnodes="2", endpoint="node0:29400"))
    assert result.status == "warn" and "10.9.9.9 (over 0.2s)" in result.detail and "/etc/hosts" in result.fix
    assert reverse_lookup.check_reverse_lookup(Job(nnodes="2", endpoint="node1:29400")).status == "ok"
    assert reverse_lookup.check_reverse_lookup(Job(elastic=True, store="etcd://h:2379")).status == "skip"
