"""How a run waits for services: the notices it gives while waiting, and the stop that ends a wait.

A run that has no rollout or reward service to go on with waits (state ``waiting``, with the reason) and
looks again every ``WAIT_POLL_S``; the run's own stop request ends the wait with ``RunStopped``.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable, Protocol, TypeVar

import grpc

WAIT_POLL_S = 0.5
Found = TypeVar("Found")


class RunStopped(Exception):
    """The run was stopped while it waited for a service."""


class Notices(Protocol):
    def log(self, message: str, kind: str = "log") -> None:
        """An event of the run, for a person (kind: log, or reward for the reward services)."""

    def waiting(self, reason: str | None) -> None:
        """The run waits for ``reason`` (state waiting); None: it goes on (state running)."""


async def wait_for(look: Callable[[], Awaitable[Found]], notices: Notices, should_stop: Callable[[], bool],
                   reason: str) -> Found:
    """``await look()`` until it finds something; meanwhile the run waits (state waiting, for ``reason``).
    RunStopped if the run is stopped meanwhile."""
    waiting = False
    while not (found := await look()):
        if not waiting:
            notices.waiting(reason)
            waiting = True
        if should_stop():
            raise RunStopped(f"the run was stopped while it waited ({reason})")
        await asyncio.sleep(WAIT_POLL_S)
    if waiting:
        notices.waiting(None)
    return found


def describe(error: BaseException) -> str:
    """A failure in one line for an event: the status and details of a failed call, else type and message."""
    if isinstance(error, grpc.aio.AioRpcError):
        return f"{error.code().name}: {error.details()}"
    return f"{type(error).__name__}: {error}"
