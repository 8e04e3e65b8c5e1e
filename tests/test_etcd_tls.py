"""The job's store on an etcd cluster that a security review would pass (issue 41): https with the members'
certificates checked against a CA, client certificates, and etcd users with a password and a token. Against real
etcd members started here with certificates made here (lab/certs.py), auth enabled as an operator would.

Each way a client can be refused (a wrong CA, no client certificate, one from another CA, a host name the
certificate does not hold, http spoken to https and the reverse, a wrong password, a user without permission, a
token whose renewal fails) must fail within seconds, naming the member and what to fix, and never echo a secret.
"""

from __future__ import annotations

import dataclasses
import re
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gradsync import cli
from gradsync.doctor import job as doctor_job
from gradsync.doctor.job import Job as DoctorJob
from gradsync.doctor.store import check_etcd
from gradsync.errors import ConfigError
from gradsync.runtime import etcd_access, run_flags
from gradsync.runtime.etcd_access import PASSWORD_VARIABLE, EtcdAccess
from gradsync.store import etcd_refusal, job_store
from gradsync.store.etcd_client import EtcdClient
from gradsync.store.etcd_refusal import EtcdRefused
from gradsync.store.etcd_store import EtcdStore
from lab import certs, etcd_cluster
from lab.elastic import finals, launch_on_loopback

PASSWORD = "correct-horse-battery"
needs_etcd = pytest.mark.skipif(
    (etcd_cluster.available() or certs.available()) is not None,
    reason=str(etcd_cluster.available() or certs.available()),
)
REFUSED_WITHIN_S = 3.0
TOKEN_TTL_S = 2  # etcd --auth-token-ttl
TOKEN_EXPIRED_S = TOKEN_TTL_S + 1.5  # etcd looks for expired tokens once a second


@dataclasses.dataclass
class Secured:
    etcd: etcd_cluster.Cluster
    files: certs.Files
    password_file: Path

    @property
    def endpoints(self) -> list[str]:
        return [m.endpoint for m in self.etcd.members]

    def access(self, **changes) -> EtcdAccess:
        """What a job's client is given: the CA, its certificate (no CN), user trainer, its password file."""
        files = self.files
        good = EtcdAccess(tls=True, cacert=str(files.ca), cert=str(files.client_cert), key=str(files.client_key))
        good = dataclasses.replace(good, user="trainer", password_file=str(self.password_file))
        return dataclasses.replace(good, **changes)

    def rdzv_conf(self) -> str:
        a = self.access()
        return f"cacert={a.cacert},cert={a.cert},key={a.key},user={a.user},password_file={a.password_file}"


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secured]:
    """Three members over https, wanting client certificates, with auth on: trainer may use gradsync/, nobody
    nothing; tokens live 2 s unused. The server's certificate names etcd.lab and 127.0.0.1, not localhost."""
    work = tmp_path_factory.mktemp("secured")
    files = certs.make(work / "pki", names=["etcd.lab"], addresses=["127.0.0.1"])
    security = etcd_cluster.Security(tls=files, client_cert_auth=True, token_ttl=TOKEN_TTL_S)
    password_file = work / "password"
    password_file.write_text(PASSWORD + "\n")
    password_file.chmod(0o600)
    with etcd_cluster.cluster(work / "etcd", members=3, security=security) as etcd:
        etcd.enable_auth({"trainer": PASSWORD, "nobody": PASSWORD})
        yield Secured(etcd, files, password_file)


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Iterator[etcd_cluster.Cluster]:
    with etcd_cluster.cluster(tmp_path_factory.mktemp("plain"), members=1) as etcd:
        yield etcd


def _store(endpoints: list[str], access: EtcdAccess, job: str = "tls") -> EtcdStore:
    return EtcdStore(endpoints, prefix=f"gradsync/{job}/", access=access)


def _refusal(endpoints: list[str], access: EtcdAccess) -> tuple[str, float]:
    """(the message of the refusal a first operation meets, the seconds it took)."""
    began = time.monotonic()
    with pytest.raises(EtcdRefused) as refused:
        _store(endpoints, access).set("k", "v")
    return refused.value.message, time.monotonic() - began


# ------------------------------------------------------------------------------ served
@needs_etcd
@pytest.mark.timeout(60)
def test_every_store_operation_is_served_over_tls_as_a_user(secured: Secured) -> None:
    store = _store(secured.endpoints, secured.access(), "ops")
    store.set("a", "1")
    assert store.get("a") == b"1" and store.add("n", 2) == 2 and store.add("n", 3) == 5
    assert store.compare_set("l", "", "x") == b"x" and store.check(["a", "n", "l"]) and not store.check(["a", "b"])
    threading.Timer(0.3, lambda: _store(secured.endpoints, secured.access(), "ops").set("late", "v")).start()
    assert store.get("late") == b"v"  # a watch, with the token in its headers
    assert store.client.tokens_made == 1


@needs_etcd
@pytest.mark.timeout(60)
def test_an_expired_token_is_renewed_once_for_every_thread_of_a_client(secured: Secured) -> None:
    client = EtcdClient(secured.endpoints, access=secured.access())
    stores = [EtcdStore(secured.endpoints, prefix="gradsync/renew/", client=client) for _ in range(4)]
    stores[0].set("a", "0")
    time.sleep(TOKEN_EXPIRED_S)
    threads = [threading.Thread(target=s.set, args=("a", str(i))) for i, s in enumerate(stores)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert client.tokens_made == 2


@needs_etcd
@pytest.mark.timeout(60)
def test_a_token_that_cannot_be_renewed_is_refused_naming_the_user(secured: Secured, tmp_path: Path) -> None:
    rotated = tmp_path / "password"
    rotated.write_text(PASSWORD)
    store = _store(secured.endpoints, secured.access(password_file=str(rotated)))
    store.set("a", "1")
    rotated.write_text("not-the-password")
    time.sleep(TOKEN_EXPIRED_S)
    with pytest.raises(EtcdRefused, match="user trainer's token expired, and making a new one failed") as refused:
        store.set("a", "2")
    assert "not-the-password" not in refused.value.message


@needs_etcd
@pytest.mark.timeout(60)
def test_check_hostname_off_connects_with_a_warning_saying_what_it_costs(secured: Secured) -> None:
    by_name = [e.replace("127.0.0.1", "localhost") for e in secured.endpoints]  # the certificate names no localhost
    with pytest.warns(RuntimeWarning, match="any certificate the CA signed passes"):
        store = _store(by_name, secured.access(check_hostname=False))
    store.set("a", "1")


# ------------------------------------------------------------------------------ refused, within seconds
REFUSALS: dict[str, tuple[Callable[[Secured], dict], str]] = {
    "a CA that did not sign the members": (lambda s: {"cacert": str(s.files.other_ca)}, "Give cacert=<the CA"),
    "no client certificate": (lambda s: {"cert": None, "key": None}, "it wants a client certificate"),
    "a client certificate of another CA": (
        lambda s: {"cert": str(s.files.other_client_cert), "key": str(s.files.other_client_key)},
        "refused the client certificate",
    ),
    "a client certificate with a CN": (
        lambda s: {"cert": str(s.files.named_client_cert), "key": str(s.files.named_client_key)},
        "no CN",
    ),
    "plain http": (
        lambda s: {"tls": False, "cacert": None, "cert": None, "key": None, "password_over_http": True},
        "etcd+https://",
    ),
    "no user": (lambda s: {"user": None, "password_file": None}, "give user=NAME"),
    "a user without permission": (
        lambda s: {"user": "nobody"},
        "readwrite gradsync/tls/; etcdctl user grant-role nobody",
    ),
}


@needs_etcd
@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_a_refused_client_is_told_what_to_fix_within_seconds(secured: Secured, case: str) -> None:
    changes, fix = REFUSALS[case]
    said, seconds = _refusal(secured.endpoints, secured.access(**changes(secured)))
    assert fix in said and any(e in said for e in secured.endpoints) and PASSWORD not in said, said
    assert seconds < REFUSED_WITHIN_S, (seconds, said)


@needs_etcd
@pytest.mark.timeout(60)
def test_a_wrong_password_is_refused_without_echoing_it(secured: Secured, tmp_path: Path) -> None:
    wrong = tmp_path / "wrong"
    wrong.write_text("hunter2")
    said, seconds = _refusal(secured.endpoints, secured.access(password_file=str(wrong)))
    assert "authentication failed" in said and f"read from {wrong}" in said and "hunter2" not in said
    assert seconds < REFUSED_WITHIN_S


@needs_etcd
@pytest.mark.timeout(60)
def test_a_host_name_the_certificate_does_not_hold_is_refused_naming_the_way_out(secured: Secured) -> None:
    by_name = [e.replace("127.0.0.1", "localhost") for e in secured.endpoints]
    said, seconds = _refusal(by_name, secured.access())
    assert "does not name localhost" in said and "check_hostname=0" in said and seconds < REFUSED_WITHIN_S


@needs_etcd
@pytest.mark.timeout(60)
def test_tls_and_a_user_against_a_plain_cluster_are_refused(plain: etcd_cluster.Cluster, secured: Secured) -> None:
    endpoints = [m.endpoint for m in plain.members]
    said, seconds = _refusal(endpoints, EtcdAccess(tls=True, cacert=str(secured.files.ca)))
    assert "does not complete a TLS handshake" in said and seconds < REFUSED_WITHIN_S
    over_http = EtcdAccess(user="trainer", password_file=str(secured.password_file), password_over_http=True)
    said, _ = _refusal(endpoints, over_http)
    assert "auth disabled" in said


# ------------------------------------------------------------------------------ the launcher, workers and doctor
@pytest.mark.long
@needs_etcd
@pytest.mark.timeout(240)
def test_a_job_trains_on_a_secured_cluster_with_torchruns_flags(secured: Secured, tmp_path: Path) -> None:
    """gradsync run --elastic --store etcd+https://... --rdzv-conf cacert=...,cert=...,key=...,user=...,
    password_file=...: the workers reach the store with the launcher's settings, and no password is written."""
    out = tmp_path / "out"
    out.mkdir()
    job = launch_on_loopback(out, secured.etcd.url, {"EPOCHS": "1"}, rdzv_conf=secured.rdzv_conf())
    output = job.communicate(timeout=200)[0]
    assert job.returncode == 0, output[-3000:]
    ended = finals(out)
    assert len(ended) == 2 and len({f["checksum"] for f in ended}) == 1
    assert PASSWORD not in output


@pytest.mark.long
@needs_etcd
@pytest.mark.timeout(120)
def test_a_launcher_whose_password_is_wrong_stops_at_once_saying_so(secured: Secured, tmp_path: Path) -> None:
    wrong = tmp_path / "wrong"
    wrong.write_text("hunter2")
    conf = secured.rdzv_conf().replace(str(secured.password_file), str(wrong))
    began = time.monotonic()
    job = launch_on_loopback(tmp_path, secured.etcd.url, {}, rdzv_conf=conf)
    output = job.communicate(timeout=60)[0]
    assert job.returncode == 2 and "authentication failed" in output and "hunter2" not in output, output[-3000:]
    assert time.monotonic() - began < 30
    # the CLI's rule, for a refusal from the server too: one line, exit 2; the traceback only when asked for
    assert "Traceback" not in output and output.splitlines()[-1].startswith("gradsync run: etcd member"), output
    job = launch_on_loopback(tmp_path, secured.etcd.url, {"GRADSYNC_DEBUG": "1"}, rdzv_conf=conf)
    output = job.communicate(timeout=60)[0]
    assert job.returncode == 2 and "Traceback" in output and "EtcdRefused" in output, output[-3000:]


@needs_etcd
@pytest.mark.timeout(60)
def test_doctor_checks_the_members_with_the_jobs_settings(secured: Secured) -> None:
    store = secured.etcd.url
    good = check_etcd(DoctorJob(store=store, store_conf=secured.rdzv_conf(), elastic=True))
    assert good.status == "ok", good
    wrong_ca = secured.rdzv_conf().replace(str(secured.files.ca), str(secured.files.other_ca))
    bad = check_etcd(DoctorJob(store=store, store_conf=wrong_ca, elastic=True))
    assert bad.status == "fail" and "Give cacert=" in bad.detail, bad


# ------------------------------------------------------------------------------ the settings, without etcd
@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> certs.Files:
    """Certificates without a cluster: what --rdzv-conf's files are checked against when the flags are read."""
    if certs.available() is not None:
        pytest.skip(str(certs.available()))
    return certs.make(tmp_path_factory.mktemp("pki"))


def test_torchruns_spelling_and_its_etcd_v2_aliases_mean_the_same(pki: certs.Files) -> None:
    ca, crt, key = str(pki.ca), str(pki.client_cert), str(pki.client_key)
    torchrun = etcd_access.from_flags("etcd://h:2379", f"protocol=https,cacert={ca},cert={crt},key={key}")
    v2 = etcd_access.from_flags("etcd://h:2379", f"protocol=https,ca_cert={ca},ssl_cert={crt},ssl_cert_key={key}")
    by_scheme = etcd_access.from_flags("etcd+https://h:2379", f"cacert={ca},cert={crt},key={key}")
    assert torchrun == v2 == by_scheme == EtcdAccess(tls=True, cacert=ca, cert=crt, key=key)


def test_the_workers_url_names_files_and_never_the_password(tmp_path: Path) -> None:
    (tmp_path / "pw").write_text(PASSWORD)
    conf = f"user=trainer,password_file={tmp_path / 'pw'},check_hostname=0"
    url = job_store.etcd_url("etcd+https://h1:2379,[::1]:2379", "job-1", conf)
    assert url.startswith("etcd+https://h1:2379,[::1]:2379/job-1?") and PASSWORD not in url
    base, access = etcd_access.from_url(url)
    assert base == "etcd+https://h1:2379,[::1]:2379/job-1"
    assert access == EtcdAccess(tls=True, user="trainer", password_file=str(tmp_path / "pw"), check_hostname=False)
    assert access.password() == PASSWORD


@pytest.mark.parametrize(
    ("store", "conf", "message"),
    [
        ("etcd://h", "password=hunter2", "readable by every user"),
        ("etcd://h", "join_timeout=5", "join_timeout: not used with --store"),
        ("etcd+https://h", "protocol=http", "disagree"),
        ("etcd://h", "cacert=/no/such/ca", "are TLS settings"),
        ("etcd+https://h", "cacert=/no/such/ca", "cacert=/no/such/ca: no such file"),
        ("etcd+https://h", "cert=/etc/hostname", "needs both cert=FILE and key=FILE"),
        ("etcd://h", "password_file=/etc/hostname", "add user=NAME"),
        ("etcd://h", "protocol=ftp", "give http or https"),
        ("etcd+https://h", "check_hostname=maybe", "give 1 or 0"),
    ],
)
def test_a_setting_that_would_not_work_is_refused_by_name(store: str, conf: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as refused:
        etcd_access.from_flags(store, conf)
    assert "hunter2" not in refused.value.message


def test_gradsync_run_takes_the_settings_with_store_and_refuses_a_query_in_it(pki: certs.Files) -> None:
    argv = ["--elastic", "--store", "etcd+https://h:2379", "--rdzv-id", "j", "--rdzv-conf", f"cacert={pki.ca}"]
    args = run_flags.parser().parse_args([*argv, "train.py"])
    run_flags.check(args, run_flags.given([*argv, "train.py"]))
    args.store += "?cacert=x"
    with pytest.raises(ConfigError, match="TLS files and the user from --rdzv-conf"):
        run_flags.check(args, set())


def test_a_password_from_the_environment_is_read_when_a_token_is_made(monkeypatch: pytest.MonkeyPatch) -> None:
    access = EtcdAccess(user="trainer")
    monkeypatch.setenv(PASSWORD_VARIABLE, "one")
    assert access.password() == "one"
    monkeypatch.setenv(PASSWORD_VARIABLE, "two")  # rotated: the next token uses it
    assert access.password() == "two"
    monkeypatch.delenv(PASSWORD_VARIABLE)
    with pytest.raises(ConfigError, match=f"password_file=PATH in --rdzv-conf, or set {PASSWORD_VARIABLE}"):
        access.password()


def test_a_refusal_mid_job_loses_the_store_at_once_with_its_reason() -> None:
    """A worker's heartbeat refused (its token's renewal failed, say) does not wait out the store-lost timeout:
    retrying would only meet the same answer."""
    said = job_store.gone_now(EtcdRefused("etcd user trainer's token expired, and making a new one failed: ..."))
    assert said is not None and "token expired" in said


# ------------------------------------------------------------------------------ bad files, refused when read
def _not_pem(f: certs.Files, tmp: Path) -> str:
    (tmp / "notes.txt").write_text("not a certificate\n")
    return str(tmp / "notes.txt")


def _der(f: certs.Files, tmp: Path) -> str:
    subprocess.run(["openssl", "x509", "-in", f.ca, "-outform", "der", "-out", tmp / "ca.der"], check=True)
    return str(tmp / "ca.der")


def _encrypted(f: certs.Files, tmp: Path) -> str:
    out = tmp / "encrypted.key"
    argv = ["openssl", "pkey", "-in", f.client_key, "-aes256", "-passout", "pass:secret", "-out", out]
    subprocess.run(argv, check=True, capture_output=True)
    return str(out)


# case: (the --rdzv-conf key given a bad file, the file, what the refusal says)
BAD_FILES: dict[str, tuple[str, Callable[[certs.Files, Path], str], str]] = {
    "a directory as cacert": ("cacert", lambda f, tmp: str(tmp), "is a directory"),
    "a missing cacert": ("cacert", lambda f, tmp: str(tmp / "missing.crt"), "no such file"),
    "a cacert that is not PEM": ("cacert", _not_pem, "is not a PEM CA certificate"),
    "a cacert in DER": ("cacert", _der, "openssl x509 -inform der"),
    "a cert that is not PEM": ("cert", _not_pem, "is not a PEM client certificate"),
    "a key that is not PEM": ("key", _not_pem, "is not a PEM client key"),
    "a key that is not the certificate's": ("key", lambda f, tmp: str(f.other_client_key), "not the certificate's"),
    "a key with a passphrase": ("key", _encrypted, "is encrypted"),
    "a missing password file": ("password_file", lambda f, tmp: str(tmp / "missing"), "no such file"),
    "a directory as password file": ("password_file", lambda f, tmp: str(tmp), "is a directory"),
}


def _bad_conf(pki: certs.Files, tmp: Path, case: str) -> tuple[str, str, str]:
    """(--rdzv-conf with the case's bad file in an otherwise good set, the key=path it must name, the words)."""
    name, make, words = BAD_FILES[case]
    good = {"cacert": str(pki.ca), "cert": str(pki.client_cert), "key": str(pki.client_key), "user": "trainer"}
    good["password_file"] = str(tmp / "password")
    (tmp / "password").write_text(PASSWORD)
    conf = good | {name: make(pki, tmp)}
    return ",".join(f"{k}={v}" for k, v in conf.items()), f"{name}={conf[name]}", words


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_a_bad_file_is_refused_when_the_flags_are_read_naming_its_key_and_path(
    pki: certs.Files, tmp_path: Path, case: str
) -> None:
    conf, named, words = _bad_conf(pki, tmp_path, case)
    with pytest.raises(ConfigError, match=re.escape(words)) as refused:
        etcd_access.from_flags("etcd+https://127.0.0.1:2379", conf)
    assert f"--rdzv-conf {named}" in refused.value.message or named in refused.value.message, refused.value.message


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_gradsync_run_and_doctor_refuse_a_bad_file_in_one_line(
    pki: certs.Files, tmp_path: Path, case: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before any connection: gradsync run exits 2 with one line; doctor fails its flags and its etcd rows."""
    conf, named, words = _bad_conf(pki, tmp_path, case)
    argv = ["--elastic", "--store", "etcd+https://127.0.0.1:9", "--rdzv-id", "j", "--rdzv-conf", conf]
    assert cli.main(["run", *argv, "train.py"]) == 2
    said = capsys.readouterr().err.splitlines()
    assert len(said) == 1 and said[0].startswith("gradsync run: ") and named in said[0] and words in said[0], said
    job, _ = doctor_job.parse(argv)
    assert job.refused is not None and named in job.refused
    etcd_row = check_etcd(job)
    assert etcd_row.status == "fail" and named in etcd_row.detail and words in etcd_row.detail, etcd_row


# ------------------------------------------------------------------------------ secure by default
def test_a_password_over_plain_http_is_refused_unless_the_operator_allows_it(tmp_path: Path) -> None:
    (tmp_path / "pw").write_text(PASSWORD)
    conf = f"user=trainer,password_file={tmp_path / 'pw'}"
    with pytest.raises(ConfigError, match="Write --store etcd\\+https://h1:2379,h2:2379 ") as refused:
        etcd_access.from_flags("etcd://h1:2379,h2:2379", conf)
    assert "cleartext" in refused.value.message and "password_over_http=1" in refused.value.message
    with pytest.raises(ConfigError, match="cleartext"):  # the client too: nothing it makes sends it over http
        EtcdClient(["h1:2379"], access=EtcdAccess(user="trainer"))
    allowed = etcd_access.from_flags("etcd://h1:2379", conf + ",password_over_http=1")
    assert (
        allowed.password_over_http
        and etcd_access.from_url(job_store.etcd_url("etcd://h1:2379", "j", conf + ",password_over_http=1"))[1]
        == allowed
    )
    EtcdClient(["h1:2379"], access=allowed)


def test_gradsync_run_sends_no_password_to_a_plain_http_member(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A listener where the etcd member would be: the launcher refuses before it connects."""
    (tmp_path / "pw").write_text(PASSWORD)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.settimeout(0.5)
        port = listener.getsockname()[1]
        conf = f"user=trainer,password_file={tmp_path / 'pw'}"
        argv = ["run", "--elastic", "--store", f"etcd://127.0.0.1:{port}", "--rdzv-id", "j", "--rdzv-conf", conf]
        assert cli.main([*argv, "train.py"]) == 2
        with pytest.raises(TimeoutError):
            listener.accept()
    assert f"etcd+https://127.0.0.1:{port}" in capsys.readouterr().err


def test_a_key_or_password_file_others_can_read_is_warned_about_as_ssh_does(pki: certs.Files, tmp_path: Path) -> None:
    key, password = tmp_path / "client.key", tmp_path / "password"
    key.write_bytes(pki.client_key.read_bytes())
    password.write_text(PASSWORD)
    conf = f"cacert={pki.ca},cert={pki.client_cert},key={key},user=trainer,password_file={password}"
    for path in (key, password):
        path.chmod(0o600)
    assert etcd_access.exposed(etcd_access.from_flags("etcd+https://h:2379", conf)) == []
    key.chmod(0o640)
    password.chmod(0o644)
    said = etcd_access.exposed(etcd_access.from_flags("etcd+https://h:2379", conf))
    assert [f"key={key}" in said[0], f"password_file={password}" in said[1]] == [True, True], said
    assert f"chmod 600 {key}" in said[0] and "(mode 0640)" in said[0] and PASSWORD not in " ".join(said)


def test_the_permission_hint_names_the_jobs_own_prefix() -> None:
    access = EtcdAccess(tls=True, user="trainer")
    said = etcd_refusal.of_answer("h:2379", "/v3/kv/put", 403, "permission denied", access, "gradsync/job-1/")
    assert (
        said is not None and "readwrite gradsync/job-1/;" in said.message and "readwrite gradsync/;" not in said.message
    )
    unknown = etcd_refusal.of_answer("h:2379", "/v3/kv/put", 403, "permission denied", access)
    assert unknown is not None and "gradsync/<--rdzv-id>/" in unknown.message
