"""Self-signed certificates for the labs and tests, made with the ``openssl`` command (``.ci/run`` installs it): a
CA, a server certificate for an etcd member (its names and addresses in subjectAltName, as etcd's own guide makes
them), a client certificate signed by that CA, and a second CA with a client of its own (what the cluster must
refuse, and what a client trusting the wrong CA holds).

    files = certs.make(tmp_path / "pki", names=["localhost"], addresses=["127.0.0.1"])
    files.ca, files.server_cert, files.server_key, files.client_cert, files.client_key, files.other_ca
"""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

DAYS = "2"  # a lab's certificates: no longer than the run needs


def available() -> str | None:
    """None if certificates can be made here, else the reason."""
    return None if shutil.which("openssl") else "the openssl command is not installed (Debian: apt-get install openssl)"


@dataclasses.dataclass(frozen=True)
class Files:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path  # no Common Name: etcd's JSON gateway refuses one that has one, once auth is enabled
    client_key: Path
    named_client_cert: Path  # CN=<client>, as etcd's gRPC clients use it for their user name
    named_client_key: Path
    other_ca: Path  # signed nothing the cluster uses: a client trusting it must refuse the server
    other_client_cert: Path  # signed by other_ca: the cluster must refuse it
    other_client_key: Path


def _openssl(*argv: str | Path) -> None:
    subprocess.run(["openssl", *map(str, argv)], check=True, capture_output=True)


def _make_ca(directory: Path, name: str) -> tuple[Path, Path]:
    cert, key = directory / f"{name}.crt", directory / f"{name}.key"
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        DAYS,
        "-subj",
        f"/CN={name}",
        "-keyout",
        key,
        "-out",
        cert,
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=keyCertSign",
    )
    return cert, key


def _sign(directory: Path, name: str, subject: str, ca: tuple[Path, Path], extensions: str) -> tuple[Path, Path]:
    """A key and a certificate ``name``.crt for ``subject``, signed by ``ca``."""
    cert, key, request, ext = (directory / f"{name}.{suffix}" for suffix in ("crt", "key", "csr", "ext"))
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", subject, "-keyout", key, "-out", request)
    ext.write_text(extensions + "\n")
    _openssl(
        "x509",
        "-req",
        "-in",
        request,
        "-CA",
        ca[0],
        "-CAkey",
        ca[1],
        "-CAcreateserial",
        "-days",
        DAYS,
        "-extfile",
        ext,
        "-out",
        cert,
    )
    key.chmod(0o600)
    return cert, key


def make(
    directory: Path,
    names: Sequence[str] = ("localhost",),
    addresses: Sequence[str] = ("127.0.0.1",),
    client: str = "gradsync",
) -> Files:
    """The certificates in ``directory``: the server's valid for ``names`` and ``addresses``; the clients' named
    ``client``."""
    directory.mkdir(parents=True, exist_ok=True)
    ca, other = _make_ca(directory, "ca"), _make_ca(directory, "other-ca")
    alt = ",".join([*(f"DNS:{n}" for n in names), *(f"IP:{a}" for a in addresses)])
    # clientAuth too: etcd's JSON gateway dials the member's own gRPC port with the server's certificate.
    server = _sign(directory, "server", "/CN=etcd", ca, f"subjectAltName={alt}\nextendedKeyUsage=serverAuth,clientAuth")
    as_client = "extendedKeyUsage=clientAuth"
    mine = _sign(directory, "client", f"/O={client}", ca, f"subjectAltName=DNS:{client}\n{as_client}")
    named = _sign(directory, "named-client", f"/CN={client}", ca, as_client)
    theirs = _sign(directory, "other-client", f"/O={client}", other, as_client)
    return Files(ca[0], *server, *mine, *named, other[0], *theirs)
