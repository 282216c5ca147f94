"""The job's secret: the tokens of executors and operators, and the TLS certificate executors pin.

One directory, shaped like a Kubernetes Secret mounted as a volume: `token` (the join token:
executors register with it), `tls.crt` (the driver's self-signed certificate) and, on the driver
and operators only, `tls.key` and `operator` (the token of status, evict and stop). The driver
serves HTTPS with the key; executors accept no other certificate, so a process that takes over
the driver's address learns nothing (a token is sent only inside a channel whose far end proved
it holds the key) and cannot command a node. The driver also signs each node's own credential
with a key derived from `tls.key` (`identity.py`).

The driver makes what is missing (`megascale launch`, local runs); on Kubernetes
`megascale secret DIR --name megascale-driver` makes it once, for `kubectl create secret`; the
Slurm script makes it on the driver's host and gives executors only `token` and `tls.crt`
(`megascale secret DIR --executors SHARED_DIR`).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import hmac
import ipaddress
import os
import secrets
import socket
import ssl
import sys
from dataclasses import dataclass
from pathlib import Path

from megascale.config.private_files import (
    UnsafePathError,
    check_secret_dir,
    private_dir,
    read_secret,
    write_private,
)

TOKEN, CERT, KEY, OPERATOR = "token", "tls.crt", "tls.key", "operator"
MIN_TOKEN_CHARS = 32


class SecretError(ValueError):
    """The secret directory is missing a part, or a part is unsafe; says which and how to fix it."""


@dataclass(frozen=True)
class JobSecret:
    directory: Path
    token: str
    cert_pem: bytes
    operator: str = ""  # the operator token (driver and operators; never an executor)
    node_key: bytes = b""  # what node credentials are signed with (the driver only)

    @property
    def cert_path(self) -> Path:
        return self.directory / CERT

    @property
    def key_path(self) -> Path:
        return self.directory / KEY


def ensure_secret(directory: str | Path, names: list[str] = ()) -> Path:
    """Make the parts of a secret directory that are missing: the two tokens, a certificate and
    key. A complete one (e.g. a mounted Kubernetes Secret, read-only) is left as it is."""
    if all((Path(directory) / part).exists() for part in (TOKEN, OPERATOR, CERT, KEY)):
        return Path(directory)
    directory = private_dir(directory)
    for part in (TOKEN, OPERATOR):
        if not (directory / part).exists():
            write_private(directory / part, secrets.token_urlsafe(32) + "\n")
    have_cert, have_key = (directory / CERT).exists(), (directory / KEY).exists()
    if have_cert != have_key:
        raise SecretError(f"{directory} has only one of {CERT} and {KEY}; remove it to make a new pair")
    if not have_cert:
        cert, key = self_signed_certificate(names)
        write_private(directory / KEY, key)
        write_private(directory / CERT, cert)
    return directory


def load_secret(directory: str | Path, need_key: bool, operator: bool = False) -> JobSecret:
    """The tokens and certificate in `directory` (the key too for the driver, `need_key`; the
    operator token for the driver and operators); an empty, short, readable-by-others or
    mismatched part, or a directory others can write, is an error that names it."""
    directory = Path(directory)
    try:
        check_secret_dir(directory, "the secret directory")
        token = _token(directory / TOKEN, "the join token")
        cert = read_secret(directory / CERT, "the driver certificate")
        key = read_secret(directory / KEY, "the driver's TLS key") if need_key else b""
        admin = _token(directory / OPERATOR, "the operator token") if need_key or operator else ""
    except UnsafePathError as exc:
        raise SecretError(f"{exc} (`megascale secret DIR` makes what is missing)") from None
    if b"BEGIN CERTIFICATE" not in cert:
        raise SecretError(f"{directory / CERT} is not a PEM certificate")
    if admin and hmac.compare_digest(admin, token):
        raise SecretError(
            f"{directory / OPERATOR} equals {directory / TOKEN}: executors would hold the operator's "
            f"power; remove {directory / OPERATOR} and run `megascale secret {directory}`"
        )
    secret = JobSecret(
        directory,
        token,
        cert,
        admin,
        hashlib.sha256(b"megascale node credentials\0" + key).digest() if need_key else b"",
    )
    if need_key:
        try:
            server_context(secret)
        except ssl.SSLError as exc:
            raise SecretError(
                f"{directory / KEY} does not match {directory / CERT} ({exc.reason or exc}): they "
                f"are not one pair; remove both and run `megascale secret {directory}`"
            ) from None
    return secret


def _token(path: Path, what: str) -> str:
    token = read_secret(path, what).decode(errors="replace").strip()
    if len(token) < MIN_TOKEN_CHARS:
        raise SecretError(
            f"{what} in {path} has {len(token)} characters; at least {MIN_TOKEN_CHARS} are needed "
            "(`megascale secret DIR` makes one)"
        )
    return token


def server_context(secret: JobSecret) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(secret.cert_path, secret.key_path)
    return ctx


def pinned_context(cert_pem: bytes) -> ssl.SSLContext:
    """Trust exactly the driver's certificate, whatever name or address it is reached by."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.check_hostname = False  # the pin replaces the name check: executors dial IPs and service names
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.load_verify_locations(cadata=cert_pem.decode())
    return ctx


def self_signed_certificate(names: list[str] = ()) -> tuple[bytes, bytes]:
    """(certificate PEM, key PEM): P-256, ten years, for localhost, this host and `names`
    (the names only help `curl --cacert`; executors pin the certificate itself)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "megascale driver")])
    alt: list[x509.GeneralName] = []
    for name in dict.fromkeys(["localhost", "127.0.0.1", "::1", socket.gethostname(), *names]):
        try:
            alt.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            alt.append(x509.DNSName(name))
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=3650))
        .add_extension(x509.SubjectAlternativeName(alt), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


# ---------------------------------------------------------------------- `megascale secret`
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", help="where to write token, operator, tls.crt and tls.key (mode 0600)")
    parser.add_argument(
        "--name",
        action="append",
        default=[],
        help="a name or address the driver is reached by (repeatable), e.g. megascale-driver",
    )
    parser.add_argument(
        "--executors",
        metavar="DIR",
        help="also write what executors need, token and tls.crt only, to DIR (e.g. on the shared "
        "filesystem, while the secret directory with tls.key and operator stays on the driver's host)",
    )


def write_executor_part(secret: JobSecret, directory: str | Path) -> Path:
    """`directory` with the executors' part of `secret`: the join token and the certificate they
    pin. Never the key (node credentials are derived from it: whoever held it could make any
    node's) nor the operator token; a directory that holds either is refused, not cleaned."""
    directory = private_dir(directory)
    if stale := [part for part in (KEY, OPERATOR) if (directory / part).exists()]:
        raise SecretError(f"{directory} holds {' and '.join(stale)}: executors must not; use another directory")
    write_private(directory / TOKEN, secret.token + "\n")
    write_private(directory / CERT, secret.cert_pem)
    return directory


def run(args: argparse.Namespace) -> int:
    old = os.umask(0o077)
    try:
        directory = ensure_secret(args.directory, args.name)
        secret = load_secret(directory, need_key=True)
        if args.executors:
            print(f"{write_executor_part(secret, args.executors)}: {TOKEN}, {CERT} (for executors)")
    except (SecretError, OSError) as exc:
        print(f"megascale secret: {exc}", file=sys.stderr)
        return 2
    finally:
        os.umask(old)
    print(
        f"{directory}: {TOKEN}, {OPERATOR}, {CERT}, {KEY}\n"
        f"Kubernetes: kubectl create secret generic megascale-secret --from-file={directory}"
    )
    return 0
