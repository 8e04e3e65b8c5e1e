"""How a client reaches the job's etcd cluster: over TLS or not, which CA it trusts, the client certificate it shows,
and the etcd user it authenticates as, with where that user's password is read from.

The launcher takes these in torchrun's spelling, ``--rdzv-conf protocol=https,cacert=CA,cert=CRT,key=KEY`` (torch's
``etcd`` rendezvous; the ``etcd-v2`` backend's ``ca_cert``, ``ssl_cert`` and ``ssl_cert_key`` too), or with the
scheme in the store's URL (``--store etcd+https://h1:2379,...``). It hands them to its workers in the store's URL
(``etcd+https://h1:2379,h2:2379/job?cacert=/abs/ca.crt&...``), which names files and never holds a secret: the
password is read from ``password_file=`` or from ``GRADSYNC_ETCD_PASSWORD`` (which the workers inherit), each time
a token is made, so that a rotated password is picked up. A password written on the command line is refused: any
user of the host can read it in ``ps``.

    >>> access = from_flags("etcd+https://node0:2379", "cacert=/etc/ssl/etcd/ca.crt,user=trainer")  # doctest: +SKIP
    >>> with_access("etcd+https://node0:2379/job-1", access)  # doctest: +SKIP
    'etcd+https://node0:2379/job-1?cacert=%2Fetc%2Fssl%2Fetcd%2Fca.crt&user=trainer'
"""

from __future__ import annotations

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
KEYS = ("protocol", *FILES, "user", "check_hostname")


@dataclasses.dataclass(frozen=True)
class EtcdAccess:
    """``tls``: https. ``cacert``: the CA that signed the members' certificates (else the system's). ``cert``,
    ``key``: the client certificate, for members started with ``--client-cert-auth``. ``user``: the etcd user (auth
    enabled), its password from ``password_file`` or ``GRADSYNC_ETCD_PASSWORD``. ``check_hostname=False``: the
    members' certificates need not name the address they are reached at (they are still checked against the CA)."""

    tls: bool = False
    cacert: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password_file: str | None = None
    check_hostname: bool = True

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
        """The TLS settings of every connection to a member; None for plain http."""
        if not self.tls:
            return None
        context = ssl.create_default_context(cafile=self.cacert)
        context.check_hostname = self.check_hostname  # the certificate is still verified against the CA
        if self.cert is not None:
            context.load_cert_chain(self.cert, self.key)
        return context

    def password_source(self) -> str:
        """Where the password is read from, for errors (never the password)."""
        return self.password_file or f"${PASSWORD_VARIABLE}"


def from_flags(store: str, rdzv_conf: str) -> EtcdAccess:
    """The access that ``--store`` and ``--rdzv-conf`` describe, checked (the files exist; no inline password)."""
    conf = {ALIASES.get(k, k): v for k, v in _pairs(rdzv_conf or "").items()}
    access = _access(conf, _tls(store, conf.get("protocol")))
    _check(access)
    return access


def _access(conf: dict[str, str], tls: bool) -> EtcdAccess:
    """The access ``conf`` (``--rdzv-conf``'s keys, or the workers' URL query) names; its files made absolute."""
    _refuse_keys(conf)
    return EtcdAccess(
        tls=tls,
        **{name: str(Path(conf[name]).absolute()) for name in FILES if conf.get(name)},
        user=conf.get("user") or None,
        check_hostname=_flag(conf.get("check_hostname", "1"), "check_hostname"),
    )


def _pairs(text: str) -> dict[str, str]:
    """``KEY=VALUE,KEY=VALUE`` as torchrun reads --rdzv-conf (its parser is private to torch)."""
    pairs = {}
    for item in (i.strip() for i in text.split(",") if i.strip()):
        key, equals, value = item.partition("=")
        if not equals or not key.strip():
            raise ConfigError(f"--rdzv-conf {text}: {item!r} is not KEY=VALUE; write KEY=VALUE,KEY=VALUE")
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


def _check(access: EtcdAccess) -> None:
    if not access.tls and (access.cacert or access.cert or access.key or not access.check_hostname):
        raise ConfigError(
            "--rdzv-conf cacert=, cert=, key= and check_hostname= are TLS settings: add protocol=https (or write "
            "--store etcd+https://...), or drop them."
        )
    if bool(access.cert) != bool(access.key):
        raise ConfigError("--rdzv-conf: a client certificate needs both cert=FILE and key=FILE; give the other one.")
    if access.password_file and not access.user:
        raise ConfigError("--rdzv-conf password_file= is the password of an etcd user: add user=NAME.")
    for name in FILES:
        path = getattr(access, name)
        if path is not None and not os.access(path, os.R_OK):
            raise ConfigError(f"--rdzv-conf {name}={path}: no such file, or not readable by this user.")


def with_access(url: str, access: EtcdAccess) -> str:
    """The store's URL for the workers: ``url`` with the scheme and settings of ``access`` (no secret)."""
    rest = url[len(etcd_scheme(url) or PLAIN) :]
    settings = {name: getattr(access, name) for name in (*FILES, "user") if getattr(access, name)}
    if not access.check_hostname:
        settings["check_hostname"] = "0"
    query = urllib.parse.urlencode(settings)
    return (TLS if access.tls else PLAIN) + rest + (f"?{query}" if query else "")


def from_url(url: str) -> tuple[str, EtcdAccess]:
    """The inverse of :func:`with_access`: (the URL without its query, the access it names)."""
    base, _, query = url.partition("?")
    return base, _access(dict(urllib.parse.parse_qsl(query)), _tls(base, None))
