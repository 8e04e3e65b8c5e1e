"""An etcd cluster for the labs and tests: one member per lab host (network namespace), or N members on loopback
ports. Each member can be killed and restarted (with its data, as a rebooted host would); everything is stopped and
removed on exit, also after a failure. Needs Debian's ``etcd-server`` (``.ci/run`` installs it).

With ``tls`` (lab/certs.py's files) the members serve https, and with ``client_cert_auth`` they want a client
certificate signed by the CA; ``enable_auth`` adds users and turns etcd's auth on, as an operator would.

    with etcd_cluster.cluster(tmp_path, members=3) as etcd:
        store = etcd.url          # etcd://127.0.0.1:P1,127.0.0.1:P2,127.0.0.1:P3, for --store
        etcd.kill(0); etcd.restart(0)
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import shutil
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

from gradsync.runtime.etcd_access import EtcdAccess
from gradsync.store.etcd_client import EtcdClient
from gradsync.testing import free_port
from lab import certs, netlab

CLIENT_PORT, PEER_PORT = 2379, 2380


def available() -> str | None:
    """None if etcd can be started here, else the reason."""
    if shutil.which("etcd") is None:
        return "etcd is not installed (Debian: apt-get install etcd-server; .ci/run installs it)"
    return None


@dataclasses.dataclass
class Member:
    name: str
    address: str
    client_port: int
    peer_port: int
    data_dir: Path
    host: netlab.Host | None = None
    process: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"{self.address}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://{self.address}:{self.peer_port}"


@dataclasses.dataclass(frozen=True)
class Security:
    """How the members serve clients: ``tls`` (https with these files), ``client_cert_auth`` (a client must show a
    certificate signed by the CA), ``token_ttl`` (etcd's --auth-token-ttl, seconds)."""

    tls: certs.Files | None = None
    client_cert_auth: bool = False
    token_ttl: int | None = None

    def flags(self) -> list[str]:
        argv = ["--auth-token-ttl", str(self.token_ttl)] if self.token_ttl else []
        if self.tls is not None:
            argv += ["--cert-file", str(self.tls.server_cert), "--key-file", str(self.tls.server_key)]
        if self.client_cert_auth and self.tls is not None:
            argv += ["--client-cert-auth", "--trusted-ca-file", str(self.tls.ca)]
        return argv

    def admin(self) -> EtcdAccess:
        """What the lab's own client (the operator) reaches the members with."""
        if self.tls is None:
            return EtcdAccess()
        client = (str(self.tls.client_cert), str(self.tls.client_key)) if self.client_cert_auth else (None, None)
        return EtcdAccess(tls=True, cacert=str(self.tls.ca), cert=client[0], key=client[1])


class Cluster:
    def __init__(self, members: list[Member], log_dir: Path, security: Security | None = None) -> None:
        self.members = members
        self.log_dir = log_dir
        self.security = security or Security()
        self._initial = ",".join(f"{m.name}={m.peer_url}" for m in members)

    @property
    def scheme(self) -> str:
        return "https" if self.security.tls else "http"

    @property
    def url(self) -> str:
        """``--store``'s value."""
        return ("etcd+https://" if self.security.tls else "etcd://") + ",".join(m.endpoint for m in self.members)

    def admin_client(self) -> EtcdClient:
        return EtcdClient([m.endpoint for m in self.members], access=self.security.admin())

    def enable_auth(self, users: dict[str, str], prefix: str = "gradsync/") -> None:
        """Add ``users`` (name: password), each with read and write on ``prefix`` only, and a root user (etcd
        wants one), then turn auth on. A user named ``nobody`` gets no permission."""
        client = self.admin_client()
        for name, password in {"root": "lab-root", **users}.items():
            client.call("/v3/auth/user/add", {"name": name, "password": password})
        client.call("/v3/auth/role/add", {"name": "root"})
        client.call("/v3/auth/user/grant", {"user": "root", "role": "root"})
        client.call("/v3/auth/role/add", {"name": "job"})
        end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
        perm = {"permType": "READWRITE", "key": _b64(prefix), "range_end": _b64(end)}
        client.call("/v3/auth/role/grant", {"name": "job", "perm": perm})
        for name in users:
            if name != "nobody":
                client.call("/v3/auth/user/grant", {"user": name, "role": "job"})
        client.call("/v3/auth/enable", {})

    def start(self, index: int, state: str = "new") -> None:
        m = self.members[index]
        argv = ["etcd", "--name", m.name, "--data-dir", str(m.data_dir), "--logger", "zap", "--log-level", "warn"]
        client = f"{self.scheme}://{m.endpoint}"
        argv += ["--listen-client-urls", client, "--advertise-client-urls", client, *self.security.flags()]
        argv += ["--listen-peer-urls", m.peer_url, "--initial-advertise-peer-urls", m.peer_url]
        argv += ["--initial-cluster", self._initial, "--initial-cluster-state", state]
        argv += ["--initial-cluster-token", "gradsync-lab", "--unsafe-no-fsync"]  # a lab: tmpfs-fast, no disk wait
        argv += ["--auto-compaction-mode", "periodic", "--auto-compaction-retention", "1h"]
        # etcd's tuning guide: a heartbeat near the round trip, an election timeout 10x it. A LAN's (the defaults,
        # 100/1000 ms, are for links up to ~50 ms): a new leader within ~0.5-1 s of losing one.
        argv += ["--heartbeat-interval", "50", "--election-timeout", "500"]
        if m.host is not None:
            argv = m.host.command(argv)
        log = open(self.log_dir / f"{m.name}.log", "a")
        m.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def kill(self, index: int) -> None:
        process = self.members[index].process
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGKILL)
            process.wait()

    def restart(self, index: int) -> None:
        """The member back with its data, as after its host rebooted: it rejoins the cluster."""
        self.kill(index)
        self.start(index, state="existing")

    def wait_healthy(self, indices: Sequence[int] | None = None, seconds: float = 30.0) -> None:
        deadline = time.monotonic() + seconds
        for i in range(len(self.members)) if indices is None else indices:
            while not self._healthy(self.members[i]):
                if time.monotonic() > deadline:
                    log = (self.log_dir / f"{self.members[i].name}.log").read_text()[-2000:]
                    raise RuntimeError(f"etcd member {self.members[i].name} not healthy within {seconds}s:\n{log}")
                time.sleep(0.1)

    def _healthy(self, m: Member) -> bool:
        url = f"{self.scheme}://{m.endpoint}/health"
        context = self.security.admin().ssl_context()
        handlers = [urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=context)]
        try:
            if m.host is not None:
                command = m.host.command(["curl", "-s", "-m", "1", *self._curl_tls(), url])
                return '"health":"true"' in subprocess.run(command, capture_output=True, text=True).stdout
            with urllib.request.build_opener(*handlers).open(url, timeout=1) as answer:
                return b'"health":"true"' in answer.read()
        except OSError:
            return False

    def _curl_tls(self) -> list[str]:
        admin = self.security.admin()
        argv = ["--cacert", admin.cacert] if admin.cacert else []
        return argv + (["--cert", admin.cert, "--key", admin.key] if admin.cert and admin.key else [])

    def stop(self) -> None:
        for i in range(len(self.members)):
            self.kill(i)


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


@contextlib.contextmanager
def cluster(
    work: Path, members: int = 3, hosts: Sequence[netlab.Host] | None = None, security: Security | None = None
) -> Iterator[Cluster]:
    """``members`` etcd members on loopback, or one on each of ``hosts`` (at its address, etcd's own ports)."""
    work.mkdir(parents=True, exist_ok=True)
    made = []
    for i in range(len(hosts) if hosts else members):
        host = hosts[i] if hosts else None
        address = host.address if host else "127.0.0.1"
        client, peer = (CLIENT_PORT, PEER_PORT) if host else (free_port(), free_port())
        made.append(Member(f"m{i}", address, client, peer, work / f"m{i}.data", host))
    etcd = Cluster(made, work, security)
    try:
        for i in range(len(made)):
            etcd.start(i)
        etcd.wait_healthy()
        yield etcd
    finally:
        etcd.stop()
        for m in made:
            shutil.rmtree(m.data_dir, ignore_errors=True)
