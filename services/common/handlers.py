"""What the server interceptors share: wrapping a method handler's behaviour, and the response write deadline.

A gRPC method handler holds one behaviour under one of four kinds (unary_unary, unary_stream, stream_unary,
stream_stream). A behaviour is either a coroutine function (a unary response, or a stream the handler writes
to its context, as grpc.health.v1.Health/Watch does) or an async generator function (a stream it yields).
``wrap_behaviour`` is the one place that tells them apart, so that each interceptor says only what it does
to each.

``ResponseWriteDeadline`` bounds how long a server-streaming handler may wait for its client to take one
response: a client that stops reading fills the stream's flow-control window, and each later write waits for
it. Past ``response_write_timeout_s`` the handler is closed (the work it drives is cancelled, what it holds
let go) and the call ends with DEADLINE_EXCEEDED. gRPC cannot send that status before the write it waits on
(one message, at most about 1 MiB) has left, so a client that never reads again sees it only when it reads
on or its own deadline passes; the service has let go of the call by then.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from typing import Callable

import grpc

KINDS = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")
Behaviour = Callable  # (request or request iterator, context) -> awaitable or async iterator


def wrap_behaviour(handler: grpc.RpcMethodHandler | None, coroutine: Callable[[Behaviour], Behaviour],
                   generator: Callable[[Behaviour], Behaviour]) -> grpc.RpcMethodHandler | None:
    """``handler`` with its behaviour replaced by ``coroutine(behaviour)`` where that is a coroutine function,
    or by ``generator(behaviour)`` where it is an async generator function; None stays None."""
    if handler is None:
        return None
    for kind in KINDS:
        behaviour = getattr(handler, kind)
        if behaviour is not None:
            wrap = generator if inspect.isasyncgenfunction(behaviour) else coroutine
            return handler._replace(**{kind: wrap(behaviour)})
    return handler


class ResponseWriteDeadline(grpc.aio.ServerInterceptor):
    """Ends a response stream whose client has not taken a response for ``timeout_s`` (TimeoutError naming
    the setting, which the error interceptor makes DEADLINE_EXCEEDED): put it after the error interceptor."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s

    async def intercept_service(self, continuation, handler_call_details):
        return wrap_behaviour(await continuation(handler_call_details), coroutine=lambda behaviour: behaviour,
                              generator=lambda behaviour: _written_within(behaviour, self.timeout_s))


def _written_within(behaviour: Behaviour, timeout_s: float) -> Behaviour:
    async def call(request, context):
        async with contextlib.aclosing(behaviour(request, context)) as responses:
            async for response in responses:
                try:
                    await asyncio.wait_for(context.write(response), timeout_s)
                except TimeoutError:
                    raise TimeoutError(f"the client took no response for {timeout_s} s "
                                       "(setting response_write_timeout_s)") from None

    return call
