"""CPU tests of services/common/errors.py: every exception a handler raises becomes a status, marked as the
service's own."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.common.errors import FROM_HANDLER, ORIGIN_KEY, ErrorInterceptor, ResourceExhausted, status_for


class Aborted(Exception):
    pass


class FakeContext:
    """Records the abort a handler's call ends with, as grpc.aio's context would send it."""

    def __init__(self):
        self.aborted = None

    async def abort(self, code, details, trailing_metadata=()):
        self.aborted = (code, details, tuple(trailing_metadata))
        raise Aborted


class CheckpointFailure(BaseException):
    """Like torch's CheckpointException: a BaseException, not an Exception."""


def handled(error: BaseException) -> tuple:
    """What the interceptor makes of a unary handler raising ``error``."""
    async def handler(request, context):
        raise error

    wrapped = asyncio.run(ErrorInterceptor().intercept_service(
        lambda details: asyncio.sleep(0, grpc.unary_unary_rpc_method_handler(handler)), FakeMethod()))
    context = FakeContext()
    with pytest.raises(Aborted):
        asyncio.run(wrapped.unary_unary(None, context))
    return context.aborted


class FakeMethod:
    method = "/meshrl.v1.Test/Call"


@pytest.mark.parametrize("error, code", [
    (ValueError("bad"), grpc.StatusCode.INVALID_ARGUMENT),
    (ResourceExhausted("too many"), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (MemoryError(), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (TimeoutError("slow"), grpc.StatusCode.DEADLINE_EXCEEDED),
    (RuntimeError("bug"), grpc.StatusCode.INTERNAL),
    (CheckpointFailure("disk full"), grpc.StatusCode.INTERNAL),
])
def test_status_for_each_kind_of_exception(error, code):
    assert status_for(error) == code


def test_a_base_exception_from_a_library_becomes_a_status_with_its_message():
    code, details, metadata = handled(CheckpointFailure("rank 0: disk full"))
    assert (code, details) == (grpc.StatusCode.INTERNAL, "CheckpointFailure: rank 0: disk full")
    assert (ORIGIN_KEY, FROM_HANDLER) in metadata


def test_a_refusal_is_marked_as_the_services_own():
    assert handled(ResourceExhausted("params.n = 9 is over")) == (
        grpc.StatusCode.RESOURCE_EXHAUSTED, "ResourceExhausted: params.n = 9 is over", ((ORIGIN_KEY, FROM_HANDLER),))


@pytest.mark.parametrize("error", [asyncio.CancelledError(), KeyboardInterrupt(), SystemExit(1)])
def test_what_ends_a_task_or_the_process_goes_on_up(error):
    with pytest.raises(type(error)):
        handled(error)
