"""A private CA and its leaf certificates: the identities of a lab's nodes, its LAN agent and its
controller (``lab up``), and of the Kubernetes lab's agents and operator.

Every leaf is good for both ends of mutual TLS (serverAuth + clientAuth): node agents serve each
other and call each other. Keys are ECDSA P-256 (CRIU's GnuTLS and Python's ``ssl`` both take it),
written 0600; nothing is regenerated while it is still valid, so restarting a lab keeps its identities.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALID = dt.timedelta(days=30)
RENEW_BEFORE = dt.timedelta(days=2)


@dataclass(frozen=True)
class Identity:
    """One leaf: where its certificate and key are, and the CA that signed it."""

    name: str
    cert: Path
    key: Path
    ca: Path

    def client_context(self) -> ssl.SSLContext:
        """For calling an agent: the agent must show a certificate of this CA, and we show ours."""
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(self.ca))
        ctx.load_cert_chain(str(self.cert), str(self.key))
        return ctx


def _write(path: Path, data: bytes, mode: int) -> None:
    tmp = path.with_name(path.name + ".new")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def _fresh(path: Path) -> bool:
    if not path.exists():
        return False
    cert = x509.load_pem_x509_certificate(path.read_bytes())
    try:  # Python 3.13's strict verification wants key identifiers on every certificate
        cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier)
    except x509.ExtensionNotFound:
        return False
    return cert.not_valid_after_utc - dt.datetime.now(dt.UTC) > RENEW_BEFORE


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _hostlike(name: str) -> bool:
    return all(c.isalnum() or c in "-." for c in name)  # a Kubernetes user (system:node:x) is not


def _wanted(name: str, ips: Sequence[str], dns: Sequence[str]) -> set[str]:
    return {*([name] if _hostlike(name) else []), *dns, *(str(ipaddress.ip_address(ip)) for ip in ips)}


def _names(cert_path: Path) -> set[str]:
    """A certificate's DNS and IP SANs: one whose names changed is made again."""
    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return set()
    return {*sans.get_values_for_type(x509.DNSName), *map(str, sans.get_values_for_type(x509.IPAddress))}


class CA:
    """The CA in ``directory`` (``ca.crt``, ``ca.key``), made on first use."""

    def __init__(self, directory: Path, label: str):
        self.dir = directory
        self.label = label
        self.cert_path, self.key_path = directory / "ca.crt", directory / "ca.key"
        directory.mkdir(parents=True, exist_ok=True)
        os.chmod(directory, 0o700)
        if not (_fresh(self.cert_path) and self.key_path.exists()):
            self._make()

    def _make(self) -> None:
        key = _key()
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"podmigrate {self.label} CA")])
        now = dt.datetime.now(dt.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + VALID + RENEW_BEFORE)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256())
        )
        _write(self.key_path, _key_pem(key), 0o600)
        _write(self.cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644)
        for old in self.dir.glob("*.crt"):  # leaves of an older CA would no longer verify
            if old != self.cert_path:
                old.unlink()

    def issue(
        self, name: str, ips: Sequence[str] = (), dns: Sequence[str] = (), orgs: Sequence[str] = (), file: str = ""
    ) -> Identity:
        """``name``'s certificate (CN=name, O=each of ``orgs``; SANs: ``ips`` and ``dns``, and ``name``
        where it is a host name), made if missing; kept as ``file`` (default: ``name``)."""
        file = file or name
        cert_path, key_path = self.dir / f"{file}.crt", self.dir / f"{file}.key"
        ident = Identity(name, cert_path, key_path, self.cert_path)
        if _fresh(cert_path) and key_path.exists() and _names(cert_path) == _wanted(name, ips, dns):
            return ident
        ca_key = serialization.load_pem_private_key(self.key_path.read_bytes(), None)
        ca_cert = x509.load_pem_x509_certificate(self.cert_path.read_bytes())
        assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
        key = _key()
        now = dt.datetime.now(dt.UTC)
        sans: list[x509.GeneralName] = [*([x509.DNSName(name)] if _hostlike(name) else []), *map(x509.DNSName, dns)]
        subject = [*(x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in orgs)]
        subject.append(x509.NameAttribute(NameOID.COMMON_NAME, name))
        sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name(subject))
            .issuer_name(ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + VALID)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False,
            )
            .add_extension(x509.KeyUsage(True, False, False, False, False, False, False, False, False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        _write(key_path, _key_pem(key), 0o600)
        _write(cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644)
        return ident
