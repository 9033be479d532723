"""The RPC metrics interceptor on a real grpc.aio server (a call that ends OK, one refused with a status, a stream
the client cancels), and the names it records them under; /metrics behind the cluster token and mTLS, scraped on
loopback."""

from __future__ import annotations

import asyncio
import http.client
import socket
import ssl
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from typer.testing import CliRunner

from services.common.auth import cluster_tls, metrics_tls
from services.common.cli import CannotStart
from services.coordctl.cli import app
from services.common.telemetry import RPC_SECONDS, MetricsServer, RpcMetricsInterceptor, split_method, status_name


def test_a_method_splits_into_its_service_and_name():
    assert split_method("/meshrl.v1.Rollout/Generate") == ("meshrl.v1.Rollout", "Generate")
    assert split_method("/grpc.health.v1.Health/Check") == ("grpc.health.v1.Health", "Check")


def test_the_status_is_cancelled_when_the_client_left_else_the_code():
    assert status_name(None, cancelled=False) == "OK"
    assert status_name(grpc.StatusCode.NOT_FOUND, cancelled=False) == "NOT_FOUND"
    assert status_name(None, cancelled=True) == "CANCELLED"


def test_a_taken_metrics_port_cannot_start_the_service_and_is_named():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(CannotStart, match=rf"127.0.0.1:{port} \(setting metrics_port\)"):
            MetricsServer("127.0.0.1", port, lambda: None)


@pytest.mark.timeout(60)
async def test_each_rpc_is_counted_under_how_it_ended():
    server = grpc.aio.server(interceptors=[RpcMetricsInterceptor()])
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            await stub.Check(health_pb2.HealthCheckRequest())
            with pytest.raises(grpc.aio.AioRpcError):
                await stub.Check(health_pb2.HealthCheckRequest(service="nothing"))
            watch = stub.Watch(health_pb2.HealthCheckRequest())  # a stream its handler writes to the context
            await watch.read()
            watch.cancel()
            for _ in range(100):
                if ("Watch", "CANCELLED") in recorded():
                    break
                await asyncio.sleep(0.05)
    finally:
        await server.stop(None)
    assert {("Check", "OK"), ("Check", "NOT_FOUND"), ("Watch", "CANCELLED")} <= recorded()


def recorded() -> set[tuple[str, str]]:
    """(method, status) of each RPC the health service served."""
    return {(sample.labels["grpc_method"], sample.labels["grpc_code"]) for metric in RPC_SECONDS.collect()
            for sample in metric.samples if sample.name.endswith("_count") and sample.value > 0
            and sample.labels["grpc_service"] == "grpc.health.v1.Health"}


def scrape(url: str, token: str | None = None, context: ssl.SSLContext | None = None) -> tuple[int, str]:
    """The status and body of a GET of ``url``, presenting ``token`` (as Prometheus's authorization does)."""
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=10, context=context) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as refused:
        return refused.code, refused.read().decode()


def test_with_a_token_only_a_scrape_that_presents_it_gets_the_metrics():
    server = MetricsServer("127.0.0.1", 0, lambda: 7, token="the-token")
    try:
        url = f"http://127.0.0.1:{server.port}/metrics"
        for presented in (None, "another-token", "the-token-and-more"):
            assert scrape(url, presented) == (401, "missing or wrong cluster token (Authorization: Bearer <token>)\n")
        status, text = scrape(url, "the-token")
        assert status == 200 and "meshrl_weight_version 7.0" in text
    finally:
        server.close()
    open_server = MetricsServer("127.0.0.1", 0, lambda: None)  # no token (loopback): open, as gRPC is
    try:
        assert scrape(f"http://127.0.0.1:{open_server.port}/metrics")[0] == 200
    finally:
        open_server.close()


def test_with_mtls_only_a_scraper_with_a_certificate_of_the_cluster_ca_and_the_token_gets_the_metrics(tmp_path,
                                                                                                    monkeypatch):
    for folder in ("cluster", "other"):
        assert CliRunner().invoke(app, ["certs", str(tmp_path / folder), "--host", "node1"]).exit_code == 0
    cluster = tmp_path / "cluster"
    monkeypatch.setenv("MESHRL_TLS_CERT", str(cluster / "node1.pem"))
    monkeypatch.setenv("MESHRL_TLS_KEY", str(cluster / "node1-key.pem"))
    monkeypatch.setenv("MESHRL_TLS_CA", str(cluster / "ca.pem"))
    cluster_tls.cache_clear()
    try:
        server = MetricsServer("127.0.0.1", 0, lambda: None, token="the-token", tls=metrics_tls())
    finally:
        cluster_tls.cache_clear()

    def client(folder: Path | None) -> ssl.SSLContext:
        """Trusts the cluster CA; presents ``folder``'s node1 certificate (None: none)."""
        context = ssl.create_default_context(cafile=cluster / "ca.pem")
        if folder is not None:
            context.load_cert_chain(folder / "node1.pem", folder / "node1-key.pem")
        return context

    try:
        url = f"https://127.0.0.1:{server.port}/metrics"
        for context in (client(None), client(tmp_path / "other")):  # no certificate, one of another CA
            with pytest.raises((ssl.SSLError, ConnectionError, urllib.error.URLError)):
                scrape(url, "the-token", context)
        with pytest.raises((ssl.SSLError, ConnectionError, urllib.error.URLError, http.client.HTTPException)):
            scrape(f"http://127.0.0.1:{server.port}/metrics", "the-token")  # plain HTTP
        assert scrape(url, None, client(cluster))[0] == 401
        with socket.create_connection(("127.0.0.1", server.port)):  # a scraper that never starts its handshake
            status, text = scrape(url, "the-token", client(cluster))  # holds no other
        assert status == 200 and "meshrl_rpc_duration_seconds" in text
    finally:
        server.close()
