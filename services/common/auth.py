"""Who may call: the cluster's shared token, and optionally TLS with client certificates (mTLS).

The token comes from ``MESHRL_TOKEN`` or from the file named by
``MESHRL_TOKEN_FILE`` (read once, never logged). With neither set the
cluster runs open, as a single-user loopback setup may: a service asked to
listen beyond loopback (``is_loopback``) without a token refuses to start
unless its ``allow_open`` setting says so. ``coordctl start-run --local``
always makes a token for its own services (in its state folder's ``token``
file). The gRPC health service answers without a token, so that
supervisors can probe.

mTLS comes on with ``MESHRL_TLS_CERT``, ``MESHRL_TLS_KEY`` and
``MESHRL_TLS_CA``: the paths of this process's PEM certificate, its private
key and the cluster's CA certificate (``coordctl certs`` makes them). Then
every server demands a client certificate signed by that CA, and every
channel presents this process's certificate and trusts only that CA. The
token is still demanded on top. Set all three or none.
"""

from __future__ import annotations

import functools
import hmac
import ipaddress
import os
import secrets
import socket
import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc

from services.common.handlers import wrap_behaviour

HEADER = "authorization"
OPEN_METHODS = ("/grpc.health.v1.Health/",)
TLS_VARIABLES = ("MESHRL_TLS_CERT", "MESHRL_TLS_KEY", "MESHRL_TLS_CA")


@functools.cache
def cluster_token() -> str | None:
    token = os.environ.get("MESHRL_TOKEN")
    if token is None and os.environ.get("MESHRL_TOKEN_FILE"):
        path = Path(os.environ["MESHRL_TOKEN_FILE"])
        try:
            token = path.read_text().strip()
        except OSError as error:
            raise ValueError(f"MESHRL_TOKEN_FILE {path}: {error.strerror}") from None
        if not token:
            raise ValueError(f"MESHRL_TOKEN_FILE {path} is empty")
    return token or None


def is_loopback(host: str) -> bool:
    """Whether a server bound to ``host`` listens on loopback only: ``host`` is an address in 127.0.0.0/8 or ::1
    (also bracketed, or IPv4-mapped), or a name every address of which is one (gRPC binds them all). The
    wildcards 0.0.0.0 and ::, an empty host, any other address, and a name that does not resolve are not."""
    name = host.strip()
    if name.startswith("[") and name.endswith("]"):
        name = name[1:-1]
    if not name:
        return False
    try:
        return _is_loopback_address(name)
    except ValueError:  # a name, not an address
        pass
    try:
        addresses = {str(info[4][0]) for info in socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)}
    except (OSError, UnicodeError):
        return False
    return bool(addresses) and all(_is_loopback_address(address) for address in addresses)


def _is_loopback_address(text: str) -> bool:
    address = ipaddress.ip_address(text)
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1 (Python 3.11 does not call it loopback)
    return (mapped or address).is_loopback


def write_token(path: Path) -> Path:
    """A fresh cluster token in ``path``, readable by its owner only (as ``MESHRL_TOKEN_FILE`` it is then read)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch(mode=0o600)
    path.write_text(secrets.token_urlsafe(32) + "\n")
    return path


@dataclass(frozen=True)
class TlsFiles:
    """The PEM bytes that mTLS needs, as read from the files the MESHRL_TLS_* variables name."""

    cert: bytes  # this process's certificate (chain), presented as server and as client
    key: bytes  # its private key
    ca: bytes  # the cluster CA's certificate: peers must present a certificate it signed


@functools.cache
def cluster_tls() -> TlsFiles | None:
    """The mTLS files, checked (PEM, key matches certificate), or None when no MESHRL_TLS_* variable is set."""
    paths = {name: os.environ.get(name, "") for name in TLS_VARIABLES}
    missing = [name for name, path in paths.items() if not path]
    if len(missing) == len(TLS_VARIABLES):
        return None
    if missing:
        given = [name for name in TLS_VARIABLES if name not in missing]
        raise ValueError(f"{', '.join(given)} set but {', '.join(missing)} not: mTLS needs all of "
                         f"{', '.join(TLS_VARIABLES)}")
    from cryptography import x509  # only where mTLS is on: a plaintext node need not have it
    from cryptography.hazmat.primitives import serialization

    cert_pem, cert = _load("MESHRL_TLS_CERT", "certificate", x509.load_pem_x509_certificate)
    key_pem, key = _load("MESHRL_TLS_KEY", "unencrypted private key",
                         lambda data: serialization.load_pem_private_key(data, password=None))
    ca_pem, _ = _load("MESHRL_TLS_CA", "certificate", x509.load_pem_x509_certificate)
    def public_der(public_key) -> bytes:
        return public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)

    if public_der(cert.public_key()) != public_der(key.public_key()):
        raise ValueError(f"MESHRL_TLS_KEY {paths['MESHRL_TLS_KEY']} is not the key of "
                         f"MESHRL_TLS_CERT {paths['MESHRL_TLS_CERT']}")
    return TlsFiles(cert_pem, key_pem, ca_pem)


def _load(variable: str, what: str, parse):
    """The bytes of the file that ``variable`` names, and ``parse`` of them; a ValueError naming both if either
    fails."""
    path = Path(os.environ[variable])
    try:
        data = path.read_bytes()
        return data, parse(data)
    except OSError as error:
        raise ValueError(f"{variable} {path}: {error.strerror}") from None
    except (ValueError, TypeError):  # TypeError: a key protected by a password
        raise ValueError(f"{variable} {path}: not a PEM {what}") from None


def server_credentials() -> grpc.ServerCredentials | None:
    """TLS that demands a client certificate from the cluster CA, or None to listen in plaintext."""
    tls = cluster_tls()
    if tls is None:
        return None
    return grpc.ssl_server_credentials([(tls.key, tls.cert)], root_certificates=tls.ca, require_client_auth=True)


def metrics_tls() -> ssl.SSLContext | None:
    """HTTPS for a service's /metrics that demands a client certificate signed by the cluster CA and presents this
    process's certificate, as its gRPC port does; None for plain HTTP (no mTLS)."""
    tls = cluster_tls()
    if tls is None:
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.verify_mode = ssl.CERT_REQUIRED
    context.load_verify_locations(cadata=tls.ca.decode())
    context.load_cert_chain(os.environ["MESHRL_TLS_CERT"], os.environ["MESHRL_TLS_KEY"])
    return context


def channel_credentials() -> grpc.ChannelCredentials | None:
    """TLS that trusts the cluster CA only and presents this process's certificate, or None for plaintext."""
    tls = cluster_tls()
    if tls is None:
        return None
    return grpc.ssl_channel_credentials(root_certificates=tls.ca, private_key=tls.key, certificate_chain=tls.cert)


def _metadata(details):
    metadata = list(details.metadata or [])
    token = cluster_token()
    if token is not None:
        metadata.append((HEADER, f"Bearer {token}"))
    return details._replace(metadata=metadata)


class _UnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(_metadata(details), request)


class _UnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(_metadata(details), request)


class _StreamUnary(grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, details, request_iterator):
        return await continuation(_metadata(details), request_iterator)


class _StreamStream(grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, details, request_iterator):
        return await continuation(_metadata(details), request_iterator)


def token_interceptors() -> list:
    """Client interceptors that add the cluster token to every call of a channel (one per call kind: a
    channel files each interceptor under the first kind it implements)."""
    return [_UnaryUnary(), _UnaryStream(), _StreamUnary(), _StreamStream()]


async def _refuse(request, context):
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong cluster token")


class TokenServerInterceptor(grpc.aio.ServerInterceptor):
    """Refuses (UNAUTHENTICATED) every call without the cluster token, health checks excepted."""

    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_METHODS):
            return handler
        presented = dict(details.invocation_metadata or ()).get(HEADER, "")
        if hmac.compare_digest(presented.encode(), self._expected):
            return handler
        return wrap_behaviour(handler, lambda _: _refuse)
