"""CPU tests of services/common/rpc.py: which failures a caller retries."""

from __future__ import annotations

import grpc
import pytest

from services.common.errors import FROM_HANDLER, ORIGIN_KEY
from services.common.rpc import is_retryable

Code = grpc.StatusCode


def failed(code: grpc.StatusCode, by_handler: bool) -> grpc.aio.AioRpcError:
    trailing = grpc.aio.Metadata((ORIGIN_KEY, FROM_HANDLER)) if by_handler else grpc.aio.Metadata()
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, "details")


@pytest.mark.parametrize("code, from_handler, transport", [
    (Code.UNAVAILABLE, True, True),
    (Code.DEADLINE_EXCEEDED, True, True),
    (Code.ABORTED, True, True),
    (Code.CANCELLED, True, True),
    (Code.RESOURCE_EXHAUSTED, False, True),  # over a limit: the same call is refused again
    (Code.INTERNAL, False, True),  # a permanent error: again
    (Code.UNKNOWN, False, True),
    (Code.INVALID_ARGUMENT, False, False),
    (Code.NOT_FOUND, False, False),
    (Code.FAILED_PRECONDITION, False, False),
    (Code.UNAUTHENTICATED, False, False),
])
def test_a_status_is_retried_when_it_is_transient(code, from_handler, transport):
    """By the service's own status (marked by its interceptor), or by gRPC's own (a connection broken mid-call,
    a process killed: its INTERNAL or UNKNOWN is the transport's, not the service's verdict)."""
    assert (is_retryable(failed(code, True)), is_retryable(failed(code, False))) == (from_handler, transport)


def test_other_failures_are_retried_when_they_are_connection_or_time_outs():
    assert [is_retryable(e) for e in (ConnectionResetError(), TimeoutError(), ValueError(), RuntimeError())] == [
        True, True, False, False]
