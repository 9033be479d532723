"""services/common/handlers.py: interceptors wrap coroutine behaviours and the write deadline makes response
streams into writes; on a real grpc.aio server, a response stream whose client stops reading is ended by the
server, its generator closed."""

from __future__ import annotations

import asyncio
import inspect

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.common.errors import ErrorInterceptor
from services.common.handlers import ResponseWriteDeadline, wrap_behaviour

SLOW_READER = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]  # a small window that never grows
MESSAGE = b"x" * 100_000


def test_interceptors_wrap_coroutines_and_the_write_deadline_makes_each_response_stream_one():
    async def unary(request, context):
        return request

    async def stream(request, context):
        yield request

    def wrapped(behaviour, kind):
        return getattr(wrap_behaviour(getattr(grpc, f"{kind}_rpc_method_handler")(behaviour), lambda _: "wrapped"),
                       kind)

    assert wrapped(unary, "unary_unary") == wrapped(unary, "unary_stream") == "wrapped"  # Health/Watch is the latter
    assert wrap_behaviour(None, str) is None
    with pytest.raises(TypeError, match="put ResponseWriteDeadline after this interceptor"):
        wrapped(stream, "unary_stream")

    async def written(behaviour, kind):
        async def continuation(details):
            return getattr(grpc, f"{kind}_rpc_method_handler")(behaviour)

        return getattr(await ResponseWriteDeadline(1.0).intercept_service(continuation, None), kind)

    assert asyncio.run(written(unary, "unary_unary")) is unary  # left as it is
    assert asyncio.run(written(unary, "unary_stream")) is unary
    for kind in ("unary_stream", "stream_stream"):
        writer = asyncio.run(written(stream, kind))
        assert not inspect.isasyncgenfunction(writer) and wrapped(writer, kind) == "wrapped"


async def serve(behaviour, timeout_s: float):
    server = grpc.aio.server(interceptors=[ErrorInterceptor(), ResponseWriteDeadline(timeout_s)])
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "test.Test", {"Stream": grpc.unary_stream_rpc_method_handler(behaviour)})])
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    return server, f"127.0.0.1:{port}"


@pytest.mark.timeout(60)
async def test_a_response_stream_its_client_stops_reading_is_ended_and_its_generator_closed():
    closed, ended = asyncio.Event(), []

    async def stream(request, context):
        context.add_done_callback(lambda done: ended.append(done.code()))
        try:
            for _ in range(20):
                yield MESSAGE
        finally:
            closed.set()

    server, address = await serve(stream, timeout_s=0.5)
    try:
        async with grpc.aio.insecure_channel(address, options=SLOW_READER) as channel:
            stalled = channel.unary_stream("/test.Test/Stream")(b"")
            await asyncio.wait_for(closed.wait(), 10)
            assert ended == [grpc.StatusCode.DEADLINE_EXCEEDED]
            stalled.cancel()
            reader = channel.unary_stream("/test.Test/Stream")(b"")  # a client that reads gets it all
            assert [len(message) async for message in reader] == [len(MESSAGE)] * 20
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=10)
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
            watch.cancel()
    finally:
        await server.stop(0)
