"""gRPC channels: options, deadlines and a cap on calls in flight.

Large batches are streamed in 1 MiB chunks, but a whole message may still
carry a few MiB, so both ends lift the 4 MiB receive default. Keepalive pings
are allowed while a long Generate or UpdateActor call carries no data.
"""

from __future__ import annotations

import asyncio
import contextlib

import grpc

from services.common.auth import channel_credentials, token_interceptors
from services.common.errors import FROM_HANDLER, ORIGIN_KEY, RETRY_AFTER_KEY

MAX_MESSAGE_BYTES = 64 << 20
MAX_CALLS_IN_FLIGHT = 512  # 2,000 in flight on one channel ended some calls CANCELLED; 1,000 did not

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.so_reuseport", 0),
]


def open_channel(address: str) -> grpc.aio.Channel:
    """A channel to a meshrl service: our options, the cluster token on every call, and mTLS if configured."""
    credentials = channel_credentials()
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS, interceptors=token_interceptors())
    return grpc.aio.secure_channel(address, credentials, options=CHANNEL_OPTIONS, interceptors=token_interceptors())


class Connection:
    """One channel to a service and a cap on the calls in flight on it.

    Use ``async with conn.slot():`` around each call (a whole stream counts as one).
    """

    def __init__(self, address: str, max_in_flight: int = MAX_CALLS_IN_FLIGHT):
        self.address = address
        self.channel = open_channel(address)
        self._slots = asyncio.Semaphore(max_in_flight)

    @contextlib.asynccontextmanager
    async def slot(self):
        async with self._slots:
            yield

    async def close(self) -> None:
        await self.channel.close()


TRANSIENT = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED,
                       grpc.StatusCode.CANCELLED})
TRANSIENT_FROM_TRANSPORT = TRANSIENT | {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INTERNAL,
                                        grpc.StatusCode.UNKNOWN}


def is_retryable(error: BaseException) -> bool:
    """True for failures where the same call may succeed on another replica or later.

    A status the called service set (its error interceptor marks it) is transient when it is UNAVAILABLE,
    DEADLINE_EXCEEDED, ABORTED or CANCELLED; its RESOURCE_EXHAUSTED (a request over a limit), INTERNAL (a
    permanent error) and every other code fail the same way again, so they are not retried (but for a busy
    service's, which ``retry_after_s`` tells apart: the same call may succeed on the same replica, later). A status
    gRPC made up itself (a connection reset mid-call, a process killed, a server out of memory quota) may also be
    RESOURCE_EXHAUSTED, INTERNAL or UNKNOWN, and is transient."""
    if isinstance(error, grpc.aio.AioRpcError):
        return error.code() in (TRANSIENT if from_handler(error) else TRANSIENT_FROM_TRANSPORT)
    return isinstance(error, (ConnectionError, TimeoutError))


def from_handler(error: grpc.aio.AioRpcError) -> bool:
    """Whether the called service's error interceptor set this status (rather than gRPC itself)."""
    return (ORIGIN_KEY, FROM_HANDLER) in tuple(error.trailing_metadata() or ())


def retry_after_s(error: BaseException) -> float | None:
    """For a call the service refused because it was busy (RESOURCE_EXHAUSTED with ``meshrl-retry-after-ms``, from
    its error interceptor): the seconds after which it may be sent again (0 where the hint is not a number of
    ms). None for every other failure, a request over a limit among them."""
    if not (isinstance(error, grpc.aio.AioRpcError) and error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            and from_handler(error)):
        return None
    hints = [value for key, value in tuple(error.trailing_metadata() or ()) if key == RETRY_AFTER_KEY]
    if not hints:
        return None
    try:
        return max(0.0, float(hints[0]) / 1000)
    except ValueError:
        return 0.0
