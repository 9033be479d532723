"""Prometheus metrics: what every service exports, and the HTTP server that serves them.

A service with ``metrics_port`` set serves ``/metrics`` there, on its own bind
address (``host``), in Prometheus's text format. Every service exports:

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
import time
from typing import Callable

import grpc
from prometheus_client import REGISTRY, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from services.common.cli import CannotStart
from services.common.handlers import wrap_behaviour

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
    """``/metrics`` over HTTP on ``host:port`` (port 0: a free one), in a thread of its own, until ``close``.
    ``weight_version`` is read at each scrape (on that thread), so it must not block."""

    def __init__(self, host: str, port: int, weight_version: Callable[[], int | None]):
        try:
            self.server, self.thread = start_http_server(port, addr=host.strip("[]"))
        except OSError as error:
            raise CannotStart(f"cannot serve /metrics on {host}:{port} (setting metrics_port): {error.strerror}; "
                              "choose another port (0 picks a free one) or stop what holds it") from None
        self.port = self.server.server_port
        self.address = f"{host}:{self.port}"
        self.collector = WeightVersion(weight_version)
        REGISTRY.register(self.collector)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        REGISTRY.unregister(self.collector)
