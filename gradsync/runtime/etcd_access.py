"""How a client reaches the job's etcd cluster: over TLS or not, which CA it trusts, the client certificate it shows,
and the etcd user it authenticates as, with where that user's password is read from.

The launcher takes these in torchrun's spelling, ``--rdzv-conf protocol=https,cacert=CA,cert=CRT,key=KEY`` (torch's
``etcd`` rendezvous; the ``etcd-v2`` backend's ``ca_cert``, ``ssl_cert`` and ``ssl_cert_key`` too), or with the
scheme in the store's URL (``--store etcd+https://h1:2379,...``). It hands them to its workers in the store's URL
(``etcd+https://h1:2379,h2:2379/job?cacert=/abs/ca.crt&...``), which names files and never holds a secret: the
password is read from ``password_file=`` or from ``GRADSYNC_ETCD_PASSWORD`` (which the workers inherit), each time
a token is made, so that a rotated password is picked up. A password written on the command line is refused: any
user of the host can read it in ``ps``. So is a user over plain http, which would send its password in cleartext,
unless the operator says ``password_over_http=1``; and the files are checked when the flags are read (each one there
and PEM, the key the certificate's), so that a bad one is named by its key, not found by OpenSSL mid-connection.

    >>> access = from_flags("etcd+https://node0:2379", "cacert=/etc/ssl/etcd/ca.crt,user=trainer")  # doctest: +SKIP
    >>> with_access("etcd+https://node0:2379/job-1", access)  # doctest: +SKIP
    'etcd+https://node0:2379/job-1?cacert=%2Fetc%2Fssl%2Fetcd%2Fca.crt&user=trainer'
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import ssl
import urllib.parse
from pathlib import Path

from gradsync.errors import ConfigError
from gradsync.runtime.endpoints import ETCD_SCHEMES, etcd_scheme

PASSWORD_VARIABLE = "GRADSYNC_ETCD_PASSWORD"
PLAIN, HTTP, TLS = ETCD_SCHEMES
# torch's etcd-v2 backend's names for the same files (torch/distributed/elastic/rendezvous/etcd_rendezvous_backend.py)
ALIASES = {"ca_cert": "cacert", "ssl_cert": "cert", "ssl_cert_key": "key"}
FILES = ("cacert", "cert", "key", "password_file")
KEYS = ("protocol", *FILES, "user", "check_hostname", "password_over_http")
# What each PEM file must hold: its first line's label (RFC 7468), as OpenSSL reads it.
_CERTIFICATE = b"-----BEGIN CERTIFICATE-----"
PEM_LABELS = {"cacert": _CERTIFICATE, "cert": _CERTIFICATE, "key": b"PRIVATE KEY-----"}  # RSA, EC, PKCS#8 keys
WHAT = {"cacert": "CA certificate", "cert": "client certificate", "key": "client key", "password_file": "password"}


@dataclasses.dataclass(frozen=True)
class EtcdAccess:
    """``tls``: https. ``cacert``: the CA that signed the members' certificates (else the system's). ``cert``,
    ``key``: the client certificate, for members started with ``--client-cert-auth``. ``user``: the etcd user (auth
    enabled), its password from ``password_file`` or ``GRADSYNC_ETCD_PASSWORD``. ``check_hostname=False``: the
    members' certificates need not name the address they are reached at (they are still checked against the CA).
    ``password_over_http``: the operator allows a user's password over plain http (in cleartext)."""

    tls: bool = False
    cacert: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password_file: str | None = None
    check_hostname: bool = True
    password_over_http: bool = False

    def password(self) -> str:
        """The user's password, read now (a rotated one is picked up at the next token)."""
        if self.password_file is not None:
            try:
                return Path(self.password_file).read_text().rstrip("\r\n")
            except OSError as exc:
                where = f"password_file={self.password_file}"
                raise ConfigError(f"etcd user {self.user}: cannot read {where} ({exc})") from None
        password = os.environ.get(PASSWORD_VARIABLE)
        if password is None:
            raise ConfigError(
                f"etcd user {self.user} has no password: give password_file=PATH in --rdzv-conf, or set "
                f"{PASSWORD_VARIABLE}."
            )
        return password

    def ssl_context(self) -> ssl.SSLContext | None:
        """The TLS settings of every connection to a member; None for plain http. A file OpenSSL cannot use is a
        ``ConfigError`` naming its key and path."""
        if not self.tls:
            return None
        try:
            context = ssl.create_default_context(cafile=self.cacert)
        except (ssl.SSLError, OSError) as exc:
            raise ConfigError(f"--rdzv-conf cacert={self.cacert}: {_unusable(exc)}{_pem_fix('cacert')}") from None
        context.check_hostname = self.check_hostname  # the certificate is still verified against the CA
        if self.cert is not None:
            try:  # a key with a passphrase: refused, not prompted for on a terminal no worker has
                context.load_cert_chain(self.cert, self.key, password=self._no_passphrase)
            except (ssl.SSLError, OSError) as exc:
                raise ConfigError(self._chain_refused(exc)) from None
        return context

    def _no_passphrase(self) -> str:
        raise ConfigError(
            f"--rdzv-conf key={self.key} is encrypted (it has a passphrase), which no worker can type: give the key "
            f"unencrypted, readable by its user only: openssl pkey -in {self.key} -out KEY; chmod 600 KEY"
        )

    def _chain_refused(self, exc: BaseException) -> str:
        where = f"--rdzv-conf cert={self.cert},key={self.key}"
        if isinstance(exc, ssl.SSLError) and exc.reason == "KEY_VALUES_MISMATCH":
            return (
                f"{where}: the key is not the certificate's (they were made apart): give the key the certificate was "
                "made for (openssl x509 -noout -pubkey -in CERT and openssl pkey -pubout -in KEY print the same)."
            )
        return f"{where}: {_unusable(exc)}{_pem_fix('cert')}"

    def password_source(self) -> str:
        """Where the password is read from, for errors (never the password)."""
        return self.password_file or f"${PASSWORD_VARIABLE}"


def _pem_fix(name: str) -> str:
    tool = "pkey" if name == "key" else "x509"
    return f" Give it in PEM (-----BEGIN ...-----); from DER: openssl {tool} -inform der -in FILE -out FILE.pem"


def _unusable(exc: BaseException) -> str:
    """What OpenSSL or the system said of a file, without its C source position."""
    if isinstance(exc, ssl.SSLError):
        return f"OpenSSL cannot use it ({exc.reason or exc.strerror or exc})."
    return f"cannot read it ({getattr(exc, 'strerror', None) or exc})."


def from_flags(store: str, rdzv_conf: str) -> EtcdAccess:
    """The access that ``--store`` and ``--rdzv-conf`` describe, checked: each file there, a file, readable and of
    its kind (PEM, the key the certificate's); no password inline, nor sent over plain http unless allowed."""
    given = conf_pairs(rdzv_conf or "")
    conf = {ALIASES.get(k, k): v for k, v in given.items()}
    access = _access(conf, _tls(store, conf.get("protocol")))
    _check(access, store, {ALIASES.get(k, k): k for k in given})
    return access


def _access(conf: dict[str, str], tls: bool) -> EtcdAccess:
    """The access ``conf`` (``--rdzv-conf``'s keys, or the workers' URL query) names; its files made absolute."""
    _refuse_keys(conf)
    return EtcdAccess(
        tls=tls,
        **{name: str(Path(conf[name]).absolute()) for name in FILES if conf.get(name)},
        user=conf.get("user") or None,
        check_hostname=_flag(conf.get("check_hostname", "1"), "check_hostname"),
        password_over_http=_flag(conf.get("password_over_http", "0"), "password_over_http"),
    )


def conf_pairs(text: str) -> dict[str, str]:
    """``KEY=VALUE,KEY=VALUE`` as torchrun reads --rdzv-conf (torch's _parse_rendezvous_config, private, which
    refuses a key without a value with a ValueError once the launch has begun), for every mode's --rdzv-conf."""
    pairs = {}
    for item in (i.strip() for i in text.split(",") if i.strip()):
        key, equals, value = item.partition("=")
        if not equals or not key.strip():
            raise ConfigError(f"--rdzv-conf {text}: {item!r} is not KEY=VALUE; write KEY=VALUE,KEY=VALUE")
        if not value.strip():
            raise ConfigError(f"--rdzv-conf {key.strip()}='' has no value: write {key.strip()}=VALUE, or drop it.")
        pairs[key.strip()] = value.strip()
    return pairs


def _refuse_keys(conf: dict[str, str]) -> None:
    if "password" in conf:
        raise ConfigError(
            "--rdzv-conf password=...: a password on the command line is readable by every user of this host (ps, "
            f"/proc); put it in a file only you can read and give password_file=PATH, or set {PASSWORD_VARIABLE}."
        )
    unknown = sorted(set(conf) - set(KEYS))
    if unknown:
        raise ConfigError(
            f"--rdzv-conf {','.join(unknown)}: not used with --store etcd://... (it takes {', '.join(KEYS)}); drop it."
        )


def _tls(store: str, protocol: str | None) -> bool:
    by_scheme = {PLAIN: None, HTTP: False, TLS: True}[etcd_scheme(store) or PLAIN]
    by_protocol = None if protocol is None else protocol.strip().lower()
    if by_protocol not in (None, "http", "https"):
        raise ConfigError(f"--rdzv-conf protocol={protocol}: give http or https.")
    if by_protocol is not None and by_scheme is not None and by_scheme != (by_protocol == "https"):
        raise ConfigError(f"--store {store} and --rdzv-conf protocol={protocol} disagree; give one of them.")
    return by_protocol == "https" if by_protocol is not None else bool(by_scheme)


def _flag(value: str, name: str) -> bool:
    if value.lower() in ("1", "true", "yes"):
        return True
    if value.lower() in ("0", "false", "no"):
        return False
    raise ConfigError(f"--rdzv-conf {name}={value}: give 1 or 0.")


def _check(access: EtcdAccess, store: str, spelled: dict[str, str]) -> None:
    """``spelled``: each key as the user wrote it (torch's etcd-v2 ``ca_cert`` for ``cacert``), to name it so."""
    if not access.tls and (access.cacert or access.cert or access.key or not access.check_hostname):
        raise ConfigError(
            "--rdzv-conf cacert=, cert=, key= and check_hostname= are TLS settings: add protocol=https (or write "
            "--store etcd+https://...), or drop them."
        )
    if bool(access.cert) != bool(access.key):
        raise ConfigError("--rdzv-conf: a client certificate needs both cert=FILE and key=FILE; give the other one.")
    if access.password_file and not access.user:
        raise ConfigError("--rdzv-conf password_file= is the password of an etcd user: add user=NAME.")
    refuse_cleartext(access, store)
    for name in FILES:
        if getattr(access, name) is not None:
            _check_file(name, getattr(access, name), spelled.get(name, name))
    access.ssl_context()  # OpenSSL's own reading: a certificate it cannot parse, a key that is not the cert's


def refuse_cleartext(access: EtcdAccess, store: str) -> None:
    """A user's password goes to etcd in its authenticate request: over plain http, anyone on the path reads it."""
    if access.user and not access.tls and not access.password_over_http:
        members = store.removeprefix(etcd_scheme(store) or PLAIN)
        raise ConfigError(
            f"--store {store} with user={access.user}: plain http would send the user's password in cleartext. "
            f"Write --store {TLS}{members} (with cacert=<the CA that signed the members' certificates> in "
            "--rdzv-conf), or add password_over_http=1 to --rdzv-conf to send it anyway."
        )


def _check_file(name: str, path: str, key: str) -> None:
    """``path`` is a readable file and, for a certificate or a key, holds a PEM block of its kind. ``key``: the
    name the user gave it (``name`` or its alias)."""
    where = f"--rdzv-conf {key}={path}"
    if os.path.isdir(path):
        raise ConfigError(f"{where} is a directory: give the {WHAT[name]} file itself.")
    if not os.path.exists(path):
        raise ConfigError(f"{where}: no such file; give the path of the {WHAT[name]} file.")
    try:
        content = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"{where}: {_unusable(exc)} Give a {WHAT[name]} file this user can read.") from None
    label = PEM_LABELS.get(name)
    if label is not None and label not in content:
        line = label.decode() if label.startswith(b"-----BEGIN") else f"-----BEGIN ...{label.decode()}"
        raise ConfigError(f"{where} is not a PEM {WHAT[name]} (it has no {line} line).{_pem_fix(name)}")


def exposed(access: EtcdAccess) -> list[str]:
    """The secrets (the client key, the password file) that others than their owner may read, each said as ssh
    says of a private key (which it refuses: here, a warning), with the ``chmod`` that closes it."""
    said = []
    for name in ("key", "password_file"):
        path = getattr(access, name)
        with contextlib.suppress(OSError):
            mode = os.stat(path).st_mode & 0o777 if path else 0
            if mode & 0o077:
                said.append(
                    f"--rdzv-conf {name}={path} is open to others than its owner (mode {mode:04o}): whoever "
                    f"reads it can act as this job's etcd client. chmod 600 {path}"
                )
    return said


def with_access(url: str, access: EtcdAccess) -> str:
    """The store's URL for the workers: ``url`` with the scheme and settings of ``access`` (no secret)."""
    rest = url[len(etcd_scheme(url) or PLAIN) :]
    settings = {name: getattr(access, name) for name in (*FILES, "user") if getattr(access, name)}
    if not access.check_hostname:
        settings["check_hostname"] = "0"
    if access.password_over_http:
        settings["password_over_http"] = "1"
    query = urllib.parse.urlencode(settings)
    return (TLS if access.tls else PLAIN) + rest + (f"?{query}" if query else "")


def from_url(url: str) -> tuple[str, EtcdAccess]:
    """The inverse of :func:`with_access`: (the URL without its query, the access it names)."""
    base, _, query = url.partition("?")
    return base, _access(dict(urllib.parse.parse_qsl(query)), _tls(base, None))
