"""``coordctl certs``: a private CA and one certificate per host, for mTLS between the services.

Every meshrl process is both a server and a client, so each host's
certificate is good for both (server and client auth) and names the host in
its subject alternative names, along with localhost and 127.0.0.1 (which
local runs and supervisors dial). Keys are ECDSA P-256, written unencrypted
with mode 0600; no file is ever overwritten, so an existing CA cannot be
replaced by accident.

    OUT_DIR/ca.pem, ca-key.pem         the CA (keep ca-key.pem off the cluster)
    OUT_DIR/<host>.pem, <host>-key.pem one pair per --host
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

ALWAYS_NAMED = ("localhost", "127.0.0.1")
CLOCK_SKEW = datetime.timedelta(hours=1)  # certificates start a little in the past, for hosts whose clocks lag


@dataclass(frozen=True)
class HostNames:
    """One host: the name its files are called by, and every DNS name or IP address peers dial it by."""

    name: str
    aliases: tuple[str, ...] = ()

    @classmethod
    def parse(cls, spec: str) -> HostNames:
        """``NAME[,ALIAS...]``, e.g. ``node1,node1.cluster.internal,10.0.0.5``."""
        names = [part.strip() for part in spec.split(",") if part.strip()]
        if not names or names[0].startswith(".") or "/" in names[0] or "\\" in names[0]:
            raise ValueError(f"--host {spec!r}: the first name is used as a file name; give a host name or IP address")
        return cls(names[0], tuple(names[1:]))

    def subject_alternative_names(self) -> x509.SubjectAlternativeName:
        names = list(dict.fromkeys((self.name, *self.aliases, *ALWAYS_NAMED)))
        return x509.SubjectAlternativeName([_general_name(name) for name in names])


def _general_name(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


def _subject(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "meshrl"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def make_ca(days: int) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A self-signed CA that may sign host certificates only (no intermediate CAs)."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_subject("meshrl cluster CA"))
        .issuer_name(_subject("meshrl cluster CA"))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
                                     encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def make_host_cert(host: HostNames, ca_key: ec.EllipticCurvePrivateKey, ca_cert: x509.Certificate,
                   *, days: int) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A key and a certificate signed by the CA, good as a TLS server and as a TLS client."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_subject(host.name))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(host.subject_alternative_names(), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False, key_cert_sign=False, crl_sign=False,
                                     encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                       critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return key, cert


def _write_new(path: Path, data: bytes, mode: int) -> None:
    """Create ``path`` with ``mode`` from the start (a key is never readable by others, even briefly)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    except FileExistsError:
        raise ValueError(f"{path} exists; certs never overwrites (choose a new folder)") from None
    with os.fdopen(fd, "wb") as file:
        file.write(data)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def write_cluster_certs(out_dir: Path, hosts: list[HostNames], days: int) -> list[Path]:
    """Write a new CA and one certificate and key per host into ``out_dir``; return the paths written."""
    names = [host.name for host in hosts]
    targets = [out_dir / "ca.pem", out_dir / "ca-key.pem"]
    targets += [out_dir / file for name in names for file in (f"{name}.pem", f"{name}-key.pem")]
    if len(set(targets)) != len(targets):
        raise ValueError(f"host names must be distinct and not clash with the CA's files, got {names}")
    for path in targets:  # refuse before writing anything
        if path.exists():
            raise ValueError(f"{path} exists; certs never overwrites (choose a new folder)")
    out_dir.mkdir(parents=True, exist_ok=True)
    ca_key, ca_cert = make_ca(days)
    _write_new(out_dir / "ca.pem", ca_cert.public_bytes(serialization.Encoding.PEM), 0o644)
    _write_new(out_dir / "ca-key.pem", _key_pem(ca_key), 0o600)
    for host in hosts:
        key, cert = make_host_cert(host, ca_key, ca_cert, days=days)
        _write_new(out_dir / f"{host.name}.pem", cert.public_bytes(serialization.Encoding.PEM), 0o644)
        _write_new(out_dir / f"{host.name}-key.pem", _key_pem(key), 0o600)
    return targets
