"""Exceptions that mean a status code, and the one interceptor that maps them.

Servicers and domain code raise plain exceptions; the interceptor turns them
into gRPC status codes at the edge:

| exception                         | status              |
| --------------------------------- | ------------------- |
| ValueError, KeyError, TypeError   | INVALID_ARGUMENT    |
| ResourceExhausted, MemoryError,   | RESOURCE_EXHAUSTED  |
| Busy                              |                     |
| FailedPrecondition                | FAILED_PRECONDITION |
| NotFound                          | NOT_FOUND           |
| Unavailable, ConnectionError,     | UNAVAILABLE         |
| a failed call to another service  |                     |
| TimeoutError                      | DEADLINE_EXCEEDED   |
| anything else                     | INTERNAL (logged)   |

"Anything else" is any ``BaseException`` a handler or a library under it
raises (torch's ``CheckpointException`` is one), but for those that end a
task or the process: ``KeyboardInterrupt``, ``SystemExit``,
``asyncio.CancelledError`` and ``GeneratorExit`` go on up. Every status the
interceptor sets carries the trailing metadata ``meshrl-origin: handler``,
which tells a caller that the service itself decided it (``rpc.is_retryable``
reads it) rather than the transport or a process that died mid-call; and
``meshrl-errno: N`` where the exception has a system error number
(``errno``: an OSError, a checkpoint the disk refused), which a caller reads
rather than the words of the message; and ``meshrl-retry-after-ms: N`` on a
``Busy`` refusal (every worker of an env service holds an episode): unlike a
request over a limit, the same request may succeed once one is free, and a
caller that knows the key (``rpc.retry_after_s``) asks again after N ms or
later, as gRPC's own retry pushback (``grpc-retry-pushback-ms``) says; one
that does not sees the RESOURCE_EXHAUSTED it always saw.
"""

from __future__ import annotations

import asyncio

import grpc
import structlog

from services.common.handlers import wrap_behaviour

log = structlog.get_logger()
ORIGIN_KEY, FROM_HANDLER = "meshrl-origin", "handler"
ERRNO_KEY = "meshrl-errno"
RETRY_AFTER_KEY = "meshrl-retry-after-ms"
PASSED_UP = (KeyboardInterrupt, SystemExit, asyncio.CancelledError, GeneratorExit, grpc.aio.AbortError)


class FailedPrecondition(RuntimeError):
    """The service is not in a state to do this (no run loaded, channel not joined, ...)."""


class NotFound(LookupError):
    """The named thing (run, channel) does not exist."""


class ResourceExhausted(RuntimeError):
    """The request asks for more than a limit of the service allows; the message names the field and setting."""


class Busy(ResourceExhausted):
    """Every unit of a capacity the service shares among its callers is in use (an env service's workers, each
    holding an episode): the same request may succeed once one is free, ``retry_after_s`` from now or later."""

    def __init__(self, message: str, retry_after_s: float):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Unavailable(RuntimeError):
    """A dependency is down; the caller may retry, elsewhere or later."""


def status_for(error: BaseException) -> grpc.StatusCode:
    if isinstance(error, (ValueError, KeyError, TypeError)):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(error, (ResourceExhausted, MemoryError)):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(error, FailedPrecondition):
        return grpc.StatusCode.FAILED_PRECONDITION
    if isinstance(error, NotFound):
        return grpc.StatusCode.NOT_FOUND
    if isinstance(error, (Unavailable, ConnectionError, grpc.aio.AioRpcError)):
        return grpc.StatusCode.UNAVAILABLE
    if isinstance(error, TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED
    return grpc.StatusCode.INTERNAL


def _message(error: BaseException) -> str:
    text = str(error.args[0]) if isinstance(error, KeyError) and error.args else str(error)
    return f"{type(error).__name__}: {text}"


async def _abort(context, method: str, error: BaseException) -> None:
    code = status_for(error)
    if code is grpc.StatusCode.INTERNAL:
        log.exception("rpc_failed", method=method)
    else:
        log.warning("rpc_refused", method=method, code=code.name, error=_message(error))
    await context.abort(code, _message(error), trailing_metadata=trailing_metadata(error))


def trailing_metadata(error: BaseException) -> tuple[tuple[str, str], ...]:
    """What a refusal carries besides its status: its origin, the system error number where it has one, and when
    to ask again where the service is busy."""
    number = getattr(error, "errno", None)
    return ((ORIGIN_KEY, FROM_HANDLER),) + (((ERRNO_KEY, str(number)),) if isinstance(number, int) else ()) + (
        ((RETRY_AFTER_KEY, str(round(error.retry_after_s * 1000))),) if isinstance(error, Busy) else ())


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Wraps every handler so that an exception becomes the status code above."""

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        return wrap_behaviour(await continuation(handler_call_details), lambda behaviour: _wrap(behaviour, method))


def _wrap(behaviour, method: str):
    async def call(request, context):
        try:
            return await behaviour(request, context)
        except PASSED_UP:
            raise
        except BaseException as error:  # noqa: BLE001 - the point of this interceptor
            await _abort(context, method, error)

    return call
