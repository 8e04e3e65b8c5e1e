"""`gradsync run`'s flags by mode (gradsync/runtime/run_flags.py): a flag a mode does not use is refused at once,
naming it, and nothing about it is defaulted or probed; HOST:PORT with IPv6 in brackets, everywhere an address is
read; the stores gradsync serves listen on the job's address only. Fast: no ranks, except one run over IPv6."""

from __future__ import annotations

import datetime
import http.server
import json
import os
import socket
import subprocess
import sys
import threading
import time
from argparse import Namespace
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist
from fake_etcd import FakeEtcdMember

from gradsync.doctor.job import check_flags, parse
from gradsync.errors import ConfigError
from gradsync.launch import elastic
from gradsync.launch.run import _prepare
from gradsync.runtime import run_flags, store_server
from gradsync.runtime.endpoints import etcd_members, join, split
from gradsync.runtime.run_flags import ELASTIC, ETCD, STANDALONE, STATIC, UNUSED
from gradsync.store.etcd_client import EtcdClient
from gradsync.store.etcd_store import parse_endpoints
from gradsync.store.job_store import open_store

SCRIPTS = Path(__file__).parent / "scripts"
ETCD_FLAGS = ["--store", "etcd://127.0.0.1:2379", "--rdzv-id", "job"]
MODES = {STATIC: [], STANDALONE: ["--standalone"], ELASTIC: ["--elastic"], ETCD: ["--elastic", *ETCD_FLAGS]}
# A valid value of each flag that some mode does not use.
GIVEN = {
    "rdzv_endpoint": ["--rdzv-endpoint", "127.0.0.1:0"],
    "master_addr": ["--master-addr", "127.0.0.1"],
    "master_port": ["--master-port", "0"],
    "rdzv_backend": ["--rdzv-backend", "c10d"],
    "rdzv_conf": ["--rdzv-conf", "join_timeout=5"],
    "rdzv_id": ["--rdzv-id", "job"],
    "standalone": ["--standalone"],
    "node_rank": ["--node-rank", "0"],
    "watchdog": ["--watchdog", "5"],
    "monitor_interval": ["--monitor-interval", "0.2"],
    "start_method": ["--start-method", "fork"],
    "event_log_handler": ["--event-log-handler", "null"],
    "role": ["--role", "trainer"],
    "redirects": ["--redirects", "1"],
    "tee": ["--tee", "1"],
    "local_ranks_filter": ["--local-ranks-filter", "0"],
    "duplicate_stdout_filters": ["--duplicate-stdout-filters", "error"],
    "duplicate_stderr_filters": ["--duplicate-stderr-filters", "error"],
    "logs_specs": ["--logs-specs", "default"],
    "numa_binding": ["--numa-binding", "node"],
    "signals_to_handle": ["--signals-to-handle", "SIGTERM"],
    "shutdown_timeout": ["--shutdown-timeout", "5"],
    "virtual_local_rank": ["--virtual-local-rank"],
}
# Where a mode takes other values: --store's --rdzv-conf says how to reach etcd (gradsync/runtime/etcd_access.py).
GIVEN_IN = {(ETCD, "rdzv_conf"): ["--rdzv-conf", "protocol=http"]}


def _refusal(argv: list[str]) -> str | None:
    """What gradsync run's flag check (the launcher's and doctor's) says of ``argv``: None if it takes them."""
    args = run_flags.parser().parse_args(argv)
    try:
        run_flags.check(args, run_flags.given(argv))
    except ConfigError as error:
        return error.message
    return None


def test_every_flag_of_gradsync_run_is_in_the_table_or_used_by_every_mode() -> None:
    """A new torchrun flag must be placed: used by every mode, or in UNUSED with why; GIVEN holds a value of each."""
    assert set(UNUSED) == set(GIVEN)
    used_everywhere = set(
        "help nnodes nproc_per_node max_restarts module no_python run_path log_dir local_addr".split()
    )
    used_everywhere |= {"elastic", "store"}  # they choose the mode (--store without --elastic is refused)
    used_everywhere |= {"verbose"}  # a refusal's traceback (gradsync/cli.py)
    dests = {a.dest for a in run_flags.parser()._actions} - {"training_script", "training_script_args"}
    assert dests == set(UNUSED) | used_everywhere, dests ^ (set(UNUSED) | used_everywhere)


@pytest.mark.parametrize("flag", sorted(GIVEN))
@pytest.mark.parametrize("mode", list(MODES))
def test_a_flag_the_mode_does_not_use_is_refused_naming_it_and_why(mode: str, flag: str) -> None:
    said = _refusal([*MODES[mode], *GIVEN_IN.get((mode, flag), GIVEN[flag]), "train.py"])
    why = UNUSED[flag].get(mode)
    if why is None:
        assert said is None, said
    else:
        assert said == f"{why.format(store='etcd://127.0.0.1:2379')}: {run_flags.flag_name(flag)} is not used; drop it."


def test_the_issues_case_in_its_words() -> None:
    argv = ["--elastic", *ETCD_FLAGS, "--rdzv-endpoint", "10.0.0.1:29400", "train.py"]
    assert _refusal(argv) == (
        "--store etcd://127.0.0.1:2379 holds the job's store: --rdzv-endpoint is not used; drop it."
    )


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--rdzv-endpoint", "node0:29400", "--master-port", "29500"], "--rdzv-endpoint node0:29400 names the"),
        (["--rdzv-endpoint", "node0:29400", "--master-addr", "node0"], "--master-addr is not used"),
        (["--rdzv-backend", "c10d", "--master-addr", "node0"], "--rdzv-backend c10d meets at --rdzv-endpoint"),
        (["--elastic", "--rdzv-endpoint", "node0:29400", "--master-port", "1"], "--master-port is not used"),
        (["--standalone", "--nnodes", "2"], "--standalone runs one node"),
    ],
)
def test_flags_another_flag_makes_unused_are_refused(argv: list[str], words: str) -> None:
    said = _refusal([*argv, "train.py"])
    assert said is not None and words in said, said


def test_the_flags_a_mode_uses_are_taken() -> None:
    for argv in (
        ["--nnodes", "2", "--master-addr", "node0", "--master-port", "29500"],  # torchrun's static rendezvous
        ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "node0:29400", "--rdzv-id", "a"],
        ["--standalone", "--rdzv-conf", "join_timeout=5", "--tee", "3", "--watchdog", "9"],
        ["--elastic", "--nnodes", "3", "--rdzv-endpoint", "node0:29400", "--local-addr", "10.0.0.2"],
        ["--elastic", "--master-addr", "node0", "--master-port", "29500", "--nnodes", "3"],
        ["--elastic", *ETCD_FLAGS, "--nnodes", "2:3", "--local-addr", "10.0.0.2", "--max-restarts", "5"],
    ):
        assert _refusal([*argv, "train.py"]) is None, argv


def test_pet_variables_a_mode_does_not_use_are_not_refused_nor_probed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Kubeflow's operator sets PET_RDZV_ENDPOINT (and PET_MASTER_PORT) beside --store etcd://: not the user's
    flags, so not refused; and not probed, even where that port is taken here."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        monkeypatch.setenv("PET_RDZV_ENDPOINT", f"127.0.0.1:{port}")
        monkeypatch.setenv("PET_MASTER_PORT", str(port))
        monkeypatch.setenv("PET_RDZV_BACKEND", "c10d")
        args = _prepare(["--elastic", *ETCD_FLAGS, "--log-dir", "/tmp", "train.py"])
    assert args.rdzv_endpoint == f"127.0.0.1:{port}" and args.rdzv_conf == "" and args.rdzv_id == "job"


def test_with_etcd_the_endpoint_is_not_defaulted_nor_probed() -> None:
    """Port 29400 and 29500 taken here changes nothing: --store etcd:// has no endpoint to serve."""
    args = _prepare(["--elastic", *ETCD_FLAGS, "--log-dir", "/tmp", "train.py"])
    assert args.rdzv_endpoint == "" and "is_host" not in args.rdzv_conf and args.rdzv_id == "job"
    assert run_flags.endpoint(args) is None


@pytest.mark.timeout(60)
def test_gradsync_run_refuses_an_unused_endpoint_in_one_line_before_probing_it() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        argv = ["run", "--elastic", *ETCD_FLAGS, "--rdzv-endpoint", f"127.0.0.1:{port}", "train.py"]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "PET_"))}
        start = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "gradsync", *argv], capture_output=True, text=True, env=env)
    assert done.returncode == 2 and time.monotonic() - start < 30
    assert done.stderr.strip() == (
        "gradsync run: --store etcd://127.0.0.1:2379 holds the job's store: --rdzv-endpoint is not used; drop it."
    )


def test_doctor_refuses_what_gradsync_run_refuses_in_its_words() -> None:
    for argv in (
        ["--elastic", *ETCD_FLAGS, "--rdzv-endpoint", "10.0.0.1:29400"],
        ["--elastic", "--watchdog", "5"],
        ["--node-rank", "1", "--nnodes", "2", "--master-addr", "node0"],
        ["--rdzv-endpoint", "fe80::1:29400"],
    ):
        result = check_flags(parse(argv)[0])
        assert result.status == "fail" and result.detail == _refusal([*argv, "train.py"]), result
    assert check_flags(parse(["--elastic", *ETCD_FLAGS])[0]).status == "ok"
    assert parse(["--nnodes", "2", "--rdzv-endpoint", "[::1]:29400"])[0].endpoint == "[::1]:29400"


# ------------------------------------------------------------------------------------------------ HOST:PORT
@pytest.mark.parametrize(
    "text, found",
    [
        ("node0:29400", ("node0", 29400)),
        ("10.0.0.1:0", ("10.0.0.1", 0)),
        ("node0", ("node0", 29400)),
        ("[::1]:29400", ("::1", 29400)),
        ("[fe80::1%eth0]:2379", ("fe80::1%eth0", 2379)),
        ("[::1]", ("::1", 29400)),
    ],
)
def test_host_and_port_ipv6_in_brackets(text: str, found: tuple[str, int]) -> None:
    assert split(text, f"--rdzv-endpoint {text}", 29400) == found
    assert split(join(*found), "x") == found


@pytest.mark.parametrize(
    "text, words",
    [
        ("::1:29400", "an IPv6 address without brackets"),
        ("fe80::1%eth0", "write it as [ADDRESS]:PORT"),
        ("[::1", "in brackets, then the port"),
        ("[::1]29400", "in brackets, then the port"),
        ("[node0]:29400", "is not an IPv6 address"),
        ("node0:99999", "is not HOST:PORT"),
        ("node0:port", "is not HOST:PORT"),
        ("no de:1", "is not a host name"),
    ],
)
def test_a_bad_host_and_port_is_refused_naming_the_flag(text: str, words: str) -> None:
    with pytest.raises(ConfigError, match=r"^gradsync: --rdzv-endpoint") as raised:
        split(text, f"--rdzv-endpoint {text}", 29400)
    assert words in raised.value.message


def test_etcd_members_take_ipv6_in_brackets() -> None:
    assert etcd_members("etcd://[::1]:2379,[fe80::1%eth0]:2379") == (["[::1]:2379", "[fe80::1%eth0]:2379"], "")
    assert etcd_members("etcd://node0,[::1]/job-1") == (["node0:2379", "[::1]:2379"], "job-1")
    for bad, words in (("etcd://::1:2379", "without brackets"), ("etcd://[::1]:0", "port 0")):
        with pytest.raises(ConfigError, match=words):
            etcd_members(bad)
    assert _refusal(["--elastic", "--store", "etcd://fe80::1:2379", "--rdzv-id", "j", "train.py"]) is not None
    assert parse_endpoints("etcd://[::1]:2379,127.0.0.1:2379/j") == (["[::1]:2379", "127.0.0.1:2379"], "j")


@pytest.fixture
def etcd_on_ipv6() -> Iterator[int]:
    """etcd's JSON gateway, as far as answering a POST goes, on [::1]."""

    class Server(http.server.ThreadingHTTPServer):
        address_family = socket.AF_INET6

    server = Server(("::1", 0), FakeEtcdMember)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def test_the_etcd_client_reaches_a_member_at_an_ipv6_address(etcd_on_ipv6: int) -> None:
    client = EtcdClient([f"[::1]:{etcd_on_ipv6}"], unavailable_s=2.0)
    assert client.call("/v3/maintenance/status", {})["version"] == "3.4.30"


# ------------------------------------------------------------------------------------------------ the store's address
def _answers(address: str, port: int) -> bool:
    try:
        with socket.create_connection((address, port), timeout=2.0):
            return True
    except OSError:
        return False


def test_a_store_served_here_listens_on_its_address_only() -> None:
    """127.0.0.1 and 127.0.0.2 are two addresses of this host: torch's server would answer on both."""
    wait = datetime.timedelta(seconds=10)
    store = store_server.serve("127.0.0.1", 0, nodes=2, timeout=wait, wait_for_workers=False)
    assert _answers("127.0.0.1", store.port) and not _answers("127.0.0.2", store.port)
    torchs = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=wait)
    assert _answers("127.0.0.2", torchs.port)  # the exposure this avoids
    client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=wait)
    client.set("k", "v")
    assert store.get("k") == b"v"


def test_the_elastic_launchers_store_over_ipv6() -> None:
    """--rdzv-endpoint [::1]:0: the launcher serves the job's store on [::1] only; its workers reach it there."""
    args = Namespace(store=None, rdzv_endpoint="[::1]:0", nnodes="2", local_addr="::1", rdzv_id="x", elastic=True)
    where, store = elastic._store(args)
    assert store is not None and where == f"[::1]:{store.port}"
    open_store(where, timeout=10).set("seen", "1")
    assert store.get("seen") == b"1" and not _answers("127.0.0.1", store.port)


def test_a_store_that_cannot_listen_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="192.0.2.1 is not an address of this host"):
        store_server.check_port("192.0.2.1", 29400, nodes=2)  # TEST-NET-1: nobody's
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ConfigError, match=f"port {port} cannot be bound on 127.0.0.1"):
            store_server.check_port("localhost", port, nodes=1)
        store_server.check_port("127.0.0.2", port, nodes=2)  # another address: free there


def test_a_name_that_is_loopback_here_listens_everywhere_on_several_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Debian maps the host name to 127.0.1.1: the other nodes know this host by that name at another address."""
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: [(socket.AF_INET, 1, 6, "", ("127.0.1.1", 0))])
    assert store_server.listen_address("node0", nodes=2) == store_server.EVERY_INTERFACE
    assert store_server.listen_address("node0", nodes=1) == "127.0.1.1"
    assert store_server.listen_address("0.0.0.0", nodes=2) == "0.0.0.0"  # asked for


@pytest.mark.long
@pytest.mark.timeout(120)
def test_a_job_rendezvous_over_ipv6(tmp_path: Path) -> None:
    """gradsync run --rdzv-endpoint [::1]:0: torch elastic's c10d rendezvous, on gradsync's store at [::1]."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "PET_"))}
    argv = ["run", "--nproc-per-node", "1", "--rdzv-endpoint", "[::1]:0", str(SCRIPTS / "env_dump.py"), str(tmp_path)]
    done = subprocess.run([sys.executable, "-m", "gradsync", *argv], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((tmp_path / "rank0.json").read_text())["sum"] == 1.0
