"""How a run waits for services: the notices it gives while waiting, and the stop that ends a wait.

A run that has no rollout or reward service to go on with waits (state ``waiting``, with the reason) and
looks again every ``WAIT_POLL_S``; the run's own stop request ends the wait with ``RunStopped``. A call that
fails for a reason the run can wait out (a checkpoint its disk refuses) is tried again, less and less often
(``retry_while``).
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
                   *, reason: str) -> Found:
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


def backoff_s(failures: int, first_s: float, most_s: float) -> float:
    """The wait after ``failures`` failed tries in a row (1, 2, ...): ``first_s``, doubled after each further
    failure, never over ``most_s``."""
    return min(first_s * 2 ** (failures - 1), most_s)


async def pause(seconds: float, should_stop: Callable[[], bool], reason: str) -> None:
    """Sleep ``seconds``, looking every WAIT_POLL_S whether the run was stopped (RunStopped, naming ``reason``)."""
    loop = asyncio.get_running_loop()
    until = loop.time() + seconds
    while (left := until - loop.time()) > 0:
        if should_stop():
            raise RunStopped(f"the run was stopped while it waited ({reason})")
        await asyncio.sleep(min(left, WAIT_POLL_S))


async def retry_while(attempt: Callable[[], Awaitable[Found]], refusal: Callable[[Exception], str | None],
                      waiting: Callable[[str | None], None], *, should_stop: Callable[[], bool],
                      first_s: float, most_s: float) -> Found:
    """``await attempt()`` until it succeeds. While it fails with an error that ``refusal`` gives a reason for,
    the run waits (``waiting(reason)``, then ``waiting(None)``) and tries again, backing off: ``first_s`` after
    the first failure, twice as long after each further one, never over ``most_s``. Any other error is raised,
    and RunStopped if the run is stopped meanwhile."""
    reason, failures = None, 0
    while True:
        try:
            found = await attempt()
        except Exception as error:
            now = refusal(error)
            if now is None:
                raise
            if now != reason:
                waiting(reason := now)
            failures += 1
            await pause(backoff_s(failures, first_s, most_s), should_stop, reason)
            continue
        if reason is not None:
            waiting(None)
        return found


def describe(error: BaseException) -> str:
    """A failure in one line for an event: the status and details of a failed call, else type and message."""
    if isinstance(error, grpc.aio.AioRpcError):
        return f"{error.code().name}: {error.details()}"
    return f"{type(error).__name__}: {error}"
