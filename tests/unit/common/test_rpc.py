"""CPU tests of services/common/rpc.py: which failures a caller retries, and which say the service was busy."""

from __future__ import annotations

import grpc
import pytest

from services.common.errors import FROM_HANDLER, ORIGIN_KEY, RETRY_AFTER_KEY, Busy, status_for, trailing_metadata
from services.common.rpc import is_retryable, retry_after_s

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


def refused(code: grpc.StatusCode, *metadata: tuple[str, str]) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*metadata), "details")


BY_HANDLER = (ORIGIN_KEY, FROM_HANDLER)


@pytest.mark.parametrize("error, after", [
    (refused(Code.RESOURCE_EXHAUSTED, BY_HANDLER, (RETRY_AFTER_KEY, "500")), 0.5),  # busy: ask again in 0.5 s
    (refused(Code.RESOURCE_EXHAUSTED, BY_HANDLER, (RETRY_AFTER_KEY, "soon")), 0.0),  # busy, its hint unreadable
    (refused(Code.RESOURCE_EXHAUSTED, BY_HANDLER, (RETRY_AFTER_KEY, "-3")), 0.0),
    (refused(Code.RESOURCE_EXHAUSTED, BY_HANDLER), None),  # a request over a limit: refused again, for good
    (refused(Code.RESOURCE_EXHAUSTED, (RETRY_AFTER_KEY, "500")), None),  # not the service's own status
    (refused(Code.UNAVAILABLE, BY_HANDLER, (RETRY_AFTER_KEY, "500")), None),
    (ConnectionResetError(), None),
])
def test_a_busy_refusal_is_told_apart_by_its_hint(error, after):
    assert retry_after_s(error) == after


def test_a_busy_refusal_is_still_resource_exhausted_to_callers_that_do_not_know_the_hint():
    """What a Busy becomes on the wire: RESOURCE_EXHAUSTED (an old caller refuses it for good, as before), with the
    hint in milliseconds beside the origin; not retryable as a replica's failure (the replica is not lost)."""
    busy = Busy("all 4 workers hold open episodes", retry_after_s=0.25)
    metadata = trailing_metadata(busy)
    assert status_for(busy) == Code.RESOURCE_EXHAUSTED and metadata == (BY_HANDLER, (RETRY_AFTER_KEY, "250"))
    error = refused(Code.RESOURCE_EXHAUSTED, *metadata)
    assert (retry_after_s(error), is_retryable(error)) == (0.25, False)
