"""What an etcd member refusing this client means, said so that an operator knows what to fix: a certificate not
signed by the CA it was given, a host name the certificate does not hold, a client certificate the member wants and
was not shown (or does not trust), http spoken to https and the reverse, a wrong password, a user without the
permission. Each is an ``EtcdRefused``, not an ``EtcdUnavailable``: retrying for ``UNAVAILABLE_S`` would only delay
the same answer.

Some refusals are certain from one answer (a certificate that fails verification, etcd's own "authentication
failed"); others look, once, like a member that stopped mid-handshake (an end of stream where a TLS 1.3 member
drops a client without a certificate). Those are ``certain=False``, and the client raises one only after every
member gave it twice (gradsync/store/etcd_client.py).
"""

from __future__ import annotations

import socket
import ssl

from gradsync.errors import GradsyncError
from gradsync.runtime.endpoints import split
from gradsync.runtime.etcd_access import PASSWORD_VARIABLE, EtcdAccess

# OpenSSL's X509_V_ERR_HOSTNAME_MISMATCH and X509_V_ERR_IP_ADDRESS_MISMATCH.
_NAME_MISMATCH = (62, 64)
_GATEWAY_CN = "CommonName of client sending a request against gateway"


class EtcdRefused(GradsyncError):
    """A member refused this client (its TLS settings or its etcd user): the message says what to fix."""

    def __init__(self, message: str, certain: bool = True) -> None:
        super().__init__(message)
        self.certain = certain


def of_connection(
    endpoint: str, exc: Exception, access: EtcdAccess, fresh: bool, handshaken: bool, timeout: float
) -> EtcdRefused | None:
    """What ``exc``, raised on a connection to ``endpoint`` (``fresh``: its first request; ``handshaken``: past
    the TLS handshake), says about this client's access, or None where it says nothing (a member down)."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return EtcdRefused(f"etcd member {endpoint}: {_unverified(endpoint, exc, access)}")
    if access.tls and isinstance(exc, ssl.SSLError | ConnectionResetError) and fresh:
        if handshaken:
            return EtcdRefused(f"etcd member {endpoint}: {_certificate_refused(access)}", certain=False)
        if isinstance(exc, ssl.SSLError):
            return EtcdRefused(
                f"etcd member {endpoint} does not complete a TLS handshake ({exc.reason or exc}): it serves plain "
                "http (write --store etcd://... without protocol=https), or it is not an etcd client port.",
                certain=False,
            )
    if not access.tls and fresh and isinstance(exc, ConnectionResetError) and _speaks_tls(endpoint, timeout):
        return EtcdRefused(
            f"etcd member {endpoint} serves https, and this client spoke plain http to it: write --store "
            "etcd+https://... (or add protocol=https to --rdzv-conf), with cacert=<the CA that signed the members' "
            "certificates>."
        )
    return None


def _unverified(endpoint: str, exc: ssl.SSLCertVerificationError, access: EtcdAccess) -> str:
    if exc.verify_code in _NAME_MISMATCH:
        host, _ = split(endpoint, endpoint)
        return (
            f"its certificate does not name {host} ({exc.verify_message}). Reach the member by a name or address "
            "its certificate holds (openssl x509 -noout -ext subjectAltName -in <etcd's --cert-file>), or reissue "
            "it with this one; check_hostname=0 in --rdzv-conf turns the check off (insecure: any certificate the "
            "CA signed passes)."
        )
    trusted = f"the CA in cacert={access.cacert}" if access.cacert else "this host's system CAs (no cacert= given)"
    return (
        f"its certificate failed verification against {trusted}: {exc.verify_message}. Give cacert=<the CA that "
        "signed etcd's --cert-file> in --rdzv-conf."
    )


def _certificate_refused(access: EtcdAccess) -> str:
    if access.cert is None:
        return (
            "it ended the connection after the TLS handshake: it wants a client certificate (etcd "
            "--client-cert-auth). Give cert=FILE,key=FILE in --rdzv-conf, signed by the CA of etcd's "
            "--trusted-ca-file."
        )
    return (
        f"it refused the client certificate cert={access.cert}: it must be signed by the CA of etcd's "
        "--trusted-ca-file and made for client authentication (extendedKeyUsage clientAuth)."
    )


def _speaks_tls(endpoint: str, timeout: float) -> bool:
    """Whether ``endpoint`` completes a TLS handshake (its certificate not checked: this only names the problem)."""
    host, port = split(endpoint, endpoint)
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        with socket.create_connection((host, port), timeout) as raw, context.wrap_socket(raw, server_hostname=host):
            return True
    except OSError:
        return False


def of_answer(
    endpoint: str, path: str, status: int, message: str, access: EtcdAccess, prefix: str | None = None
) -> EtcdRefused | None:
    """What etcd's answer ``status``, ``message`` to ``path`` says about this client's access (whose keys are under
    ``prefix``, where known), or None."""
    said = f"etcd member {endpoint} refused {path}: {message!r}"
    if _GATEWAY_CN in message:
        return EtcdRefused(
            f"{said}. With auth enabled, etcd's JSON gateway (which gradsync speaks) refuses a client certificate that "
            "has a Common Name (etcd 3.4+: it would not be the user). Use a client certificate whose subject has no "
            "CN (its name in subjectAltName), and authenticate with user= and a password."
        )
    if "authentication failed" in message:
        return EtcdRefused(
            f"{said}. Check user={access.user} and its password (read from {access.password_source()}): etcdctl "
            f"--user {access.user} auth status"
        )
    if "authentication is not enabled" in message:
        return EtcdRefused(
            f"{said}. The cluster has auth disabled, so user={access.user} would protect nothing: enable it (etcdctl "
            "auth enable) or drop user= and password_file= from --rdzv-conf."
        )
    if status == 403 or "permission denied" in message or "user name is empty" in message:
        return EtcdRefused(f"{said}. {_permission(access, prefix)}")
    return None


def _permission(access: EtcdAccess, prefix: str | None) -> str:
    if access.user is None:
        return (
            "The cluster has auth enabled: give user=NAME and password_file=PATH in --rdzv-conf (or the password in "
            f"${PASSWORD_VARIABLE})."
        )
    # The job's own keys, not gradsync/: a user of every job could read and overwrite every other job's state.
    keys = prefix or "gradsync/<--rdzv-id>/"
    role = f"gradsync-{prefix.removeprefix('gradsync/').strip('/')}" if prefix else "gradsync"
    return (
        f"Grant user {access.user} read and write on this job's keys, {keys}: etcdctl role add {role}; etcdctl role "
        f"grant-permission {role} --prefix=true readwrite {keys}; etcdctl user grant-role {access.user} {role}"
    )
