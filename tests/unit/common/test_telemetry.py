"""The RPC metrics interceptor on a real grpc.aio server (a call that ends OK, one refused with a status, a stream
the client cancels), and the names it records them under."""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.common.cli import CannotStart
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
