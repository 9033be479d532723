"""Prometheus metrics: what every service exports, and the HTTP server that serves them.

A service with ``metrics_port`` set serves ``/metrics`` there, on its own bind
address (``host``), in Prometheus's text format, behind the same door as its
gRPC port: with a cluster token a scrape must present it
(``Authorization: Bearer <token>``, else 401), with mTLS it is HTTPS that
demands a client certificate signed by the cluster CA, and with both both. It
is open only where gRPC is (no token: loopback, or ``allow_open``). A scraper
that stalls is dropped after ``SCRAPE_TIMEOUT_S`` without holding the others.
Every service exports:

- ``meshrl_rpc_duration_seconds{grpc_service, grpc_method, grpc_code}``: a
  histogram of the RPCs it served, by final status (its ``_count`` counts
  them), recorded by ``RpcMetricsInterceptor``;
- ``meshrl_weight_version``: the actor weight version it holds or serves
  (absent where it holds none: the coordinator, a reward service, a service
  before its first run);
- prometheus_client's ``process_*`` (resident memory, CPU seconds, open
  files) and ``python_*`` metrics.

Each kind adds its own in its ``telemetry.py`` (the rollout's tokens, the
trainer's phases and memory, the reward's samples, the coordinator's runs and
heartbeats).
"""

from __future__ import annotations

import asyncio
import hmac
import socket
import ssl
import threading
import time
from socketserver import ThreadingMixIn
from typing import Callable
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

import grpc
from prometheus_client import REGISTRY, Histogram, make_wsgi_app
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from services.common.cli import CannotStart
from services.common.handlers import wrap_behaviour

SCRAPE_TIMEOUT_S = 10.0

RPC_SECONDS = Histogram(
    "meshrl_rpc_duration_seconds", "Time from an RPC's arrival to its final status, by method and status code",
    ["grpc_service", "grpc_method", "grpc_code"],
    buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 1800))


def split_method(full_method: str) -> tuple[str, str]:
    """'/meshrl.v1.Rollout/Generate' -> ('meshrl.v1.Rollout', 'Generate')."""
    service, _, method = full_method.lstrip("/").rpartition("/")
    return service, method


def status_name(code: grpc.StatusCode | None, cancelled: bool) -> str:
    """How an RPC ended: CANCELLED when its client went away, else its code (a handler that returned without
    setting one ended OK)."""
    if cancelled:
        return "CANCELLED"
    return "OK" if code is None else code.name


class RpcMetricsInterceptor(grpc.aio.ServerInterceptor):
    """Times every RPC from its arrival to its final status (including refusals by the interceptors after this
    one, and calls the client cancelled) into RPC_SECONDS. Put it first, so that it sees them all."""

    async def intercept_service(self, continuation, handler_call_details):
        service, method = split_method(handler_call_details.method)
        return wrap_behaviour(await continuation(handler_call_details),
                              lambda behaviour: _timed(behaviour, service, method))


class _Timing:
    """One RPC's clock, read into RPC_SECONDS when gRPC says the RPC is done."""

    def __init__(self, service: str, method: str, context):
        self.service, self.method = service, method
        self.started = time.perf_counter()
        self.cancelled = False  # the handler was cancelled: gRPC's context does not say so when the client left
        context.add_done_callback(self.record)

    def record(self, context) -> None:
        status = status_name(context.code(), self.cancelled or context.cancelled())
        RPC_SECONDS.labels(self.service, self.method, status).observe(time.perf_counter() - self.started)


def _timed(behaviour, service: str, method: str):
    async def call(request, context):
        timing = _Timing(service, method, context)
        try:
            return await behaviour(request, context)
        except asyncio.CancelledError:
            timing.cancelled = True
            raise

    return call


class WeightVersion(Collector):
    """``meshrl_weight_version``, read from the servicer at each scrape (no sample while it holds none)."""

    def __init__(self, weight_version: Callable[[], int | None]):
        self.weight_version = weight_version

    def collect(self):
        family = GaugeMetricFamily("meshrl_weight_version", "The actor weight version this service holds or serves")
        version = self.weight_version()
        if version is not None:
            family.add_metric([], version)
        yield family


class MetricsServer:
    """``/metrics`` over HTTP on ``host:port`` (port 0: a free one), in a thread of its own, until ``close``: for
    callers presenting ``token`` (None: any), over ``tls`` (an SSL context that demands a client certificate;
    None: plain HTTP). ``weight_version`` is read at each scrape (on that thread), so it must not block."""

    def __init__(self, host: str, port: int, weight_version: Callable[[], int | None], *, token: str | None = None,
                 tls: ssl.SSLContext | None = None):
        app = make_wsgi_app(REGISTRY)
        try:
            self.server = MetricsHTTPServer(*bind_address(host, port))
        except OSError as error:
            raise CannotStart(f"cannot serve /metrics on {host}:{port} (setting metrics_port): {error.strerror}; "
                              "choose another port (0 picks a free one) or stop what holds it") from None
        self.server.set_app(app if token is None else bearer_only(app, token))
        if tls is not None:  # the handshake happens on the scrape's own thread, under its timeout
            self.server.socket = tls.wrap_socket(self.server.socket, server_side=True, do_handshake_on_connect=False)
        self.thread = threading.Thread(target=self.server.serve_forever, name="metrics", daemon=True)
        self.thread.start()
        self.port = self.server.server_port
        self.address = f"{host}:{self.port}"
        self.collector = WeightVersion(weight_version)
        REGISTRY.register(self.collector)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        REGISTRY.unregister(self.collector)


def bind_address(host: str, port: int) -> tuple[tuple, socket.AddressFamily]:
    """The socket address that ``host`` (a name, an IPv4 or IPv6 address, bracketed or not) binds ``port`` to,
    and its address family."""
    family, _, _, _, address = socket.getaddrinfo(host.strip("[]") or None, port, type=socket.SOCK_STREAM,
                                                  flags=socket.AI_PASSIVE)[0]
    return address, family


def bearer_only(app, token: str):
    """The WSGI ``app``, answering only requests that present ``token`` (``Authorization: Bearer``); 401 to the
    others."""
    expected = f"Bearer {token}".encode()

    def guarded(environ, start_response):
        if hmac.compare_digest(environ.get("HTTP_AUTHORIZATION", "").encode(), expected):
            return app(environ, start_response)
        start_response("401 Unauthorized", [("Content-Type", "text/plain; charset=utf-8"),
                                            ("WWW-Authenticate", 'Bearer realm="meshrl"')])
        return [b"missing or wrong cluster token (Authorization: Bearer <token>)\n"]

    return guarded


class MetricsHTTPServer(ThreadingMixIn, WSGIServer):
    """Each scrape on a thread of its own, so that one that stalls holds no other."""

    daemon_threads = True

    def __init__(self, address: tuple, family: socket.AddressFamily):
        self.address_family = family  # read when the socket is made, below
        super().__init__(address, ScrapeHandler)

    def handle_error(self, request, client_address) -> None:
        """A scraper that went away, timed out or failed the TLS handshake: nothing to answer, nothing to log."""


class ScrapeHandler(WSGIRequestHandler):
    timeout = SCRAPE_TIMEOUT_S  # a scraper silent this long (in its handshake, or its request) is dropped

    def log_message(self, format: str, *args) -> None:
        """Scrapes are not logged (every few seconds from each Prometheus)."""
