"""The cluster's shared token: every call carries it, every service refuses a call without it.

The token comes from ``MESHRL_TOKEN`` or from the file named by
``MESHRL_TOKEN_FILE`` (read once, never logged). With neither set the
cluster runs open, as a single-user loopback setup may; ``coordctl
start-run --local`` always makes a token for its own services. The gRPC
health service answers without a token, so that supervisors can probe.
"""

from __future__ import annotations

import functools
import hmac
import os
from pathlib import Path

import grpc

HEADER = "authorization"
OPEN_METHODS = ("/grpc.health.v1.Health/",)


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


def _refuse(kind: str):
    async def refuse(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong cluster token")

    async def refuse_stream(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong cluster token")
        yield  # pragma: no cover - makes this an async generator, as stream handlers are

    return refuse_stream if kind.endswith("_stream") else refuse


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
        kinds = {"unary_unary": grpc.unary_unary_rpc_method_handler, "unary_stream": grpc.unary_stream_rpc_method_handler,
                 "stream_unary": grpc.stream_unary_rpc_method_handler,
                 "stream_stream": grpc.stream_stream_rpc_method_handler}
        for kind, make in kinds.items():
            if getattr(handler, kind) is not None:
                return make(_refuse(kind), handler.request_deserializer, handler.response_serializer)
        return handler
