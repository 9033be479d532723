"""What the server interceptors share: wrapping a method handler's behaviour, and the response write deadline.

A gRPC method handler holds one behaviour under one of four kinds (unary_unary, unary_stream, stream_unary,
stream_stream). A behaviour is either a coroutine function (a unary response, or a stream the handler writes
to its context, as grpc.health.v1.Health/Watch does) or an async generator function (a stream it yields).
``ResponseWriteDeadline``, the innermost interceptor, makes every async generator a coroutine function that
writes its responses to the context, so the interceptors outside it wrap coroutine functions only
(``wrap_behaviour``).

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


def behaviour_of(handler: grpc.RpcMethodHandler) -> tuple[str, Behaviour]:
    """The kind of a method handler and the behaviour it holds under it."""
    return next((kind, getattr(handler, kind)) for kind in KINDS if getattr(handler, kind) is not None)


def wrap_behaviour(handler: grpc.RpcMethodHandler | None,
                   wrap: Callable[[Behaviour], Behaviour]) -> grpc.RpcMethodHandler | None:
    """``handler`` with its behaviour replaced by ``wrap(behaviour)``; None stays None. The behaviour is a
    coroutine function (TypeError for an async generator: ResponseWriteDeadline belongs after this
    interceptor)."""
    if handler is None:
        return None
    kind, behaviour = behaviour_of(handler)
    if inspect.isasyncgenfunction(behaviour):
        raise TypeError(f"the {kind} behaviour yields its responses: put ResponseWriteDeadline after this "
                        "interceptor, which makes it write them")
    return handler._replace(**{kind: wrap(behaviour)})


class ResponseWriteDeadline(grpc.aio.ServerInterceptor):
    """Ends a response stream whose client has not taken a response for ``timeout_s`` (TimeoutError naming
    the setting, which the error interceptor makes DEADLINE_EXCEEDED): put it after the error interceptor."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        kind, behaviour = behaviour_of(handler)
        if not inspect.isasyncgenfunction(behaviour):
            return handler
        return handler._replace(**{kind: _written_within(behaviour, self.timeout_s)})


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
