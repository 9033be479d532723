"""The gate between generation and weight swaps, shared by the rollout engines.

Both engines receive the weights while generation goes on and swap them in
behind a ``SwapGate``. What becomes of the Generate calls in flight at the
swap (``PartialRollout``): they finish under the old weights first (``finish``);
they are stopped and sampled again, whole, under the new ones (``restart``;
samples are seeded from (seed, index), so a restarted call returns exactly
what a fresh call under the new weights returns); or they are held only for
the swap itself and go on under the new weights, keeping the tokens (and the
KV cache) they have (``keep``): a sample then spans versions, and the engine
stamps each with the versions of its first and last tokens.

An engine runs each Generate call through ``SwapGate.run`` as a
``GenerationCall``; a call that a restarting swap interrupts stops by raising
``GenerationInterrupted`` and is run again once the swap is done. A call
whose client goes away is cancelled: async work (vLLM's requests) is
cancelled with it, work on a thread (the hf engine) sees ``should_stop`` and
ends at its next token step, so abandoned work does not hold the engine.
Each sync ends in a ``WeightSwap``, what the engine reports of it. A swap that fails after part of the
new weights went in leaves the engine damaged: it refuses Generate (``not_whole``, UNAVAILABLE, so the call
is sent elsewhere) until a sync swaps a whole version in.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Awaitable, Callable, Literal, TypeVar

import structlog

from services.common.errors import Unavailable

log = structlog.get_logger()
Result = TypeVar("Result")
PartialRollout = Literal["finish", "restart", "keep"]  # what a swap does with the Generate calls in flight (see above)


@dataclass(frozen=True, kw_only=True)
class WeightSwap:
    """One weight sync as a rollout engine saw it."""

    version: int
    transfer_s: float  # receiving the weights (generation may go on meanwhile)
    pause_s: float  # generation held back: the calls in flight finishing (``finish``), the swap itself
    stages: dict[str, float] = dataclasses.field(default_factory=dict)  # seconds per stage, where the engine knows


def not_whole(damaged: str) -> Unavailable:
    """The refusal of a Generate call by an engine whose weights are not one whole version (``damaged``: why)."""
    return Unavailable(f"this rollout's weights are not one whole version ({damaged}); it generates again once a "
                       "sync swaps one in")


def failed_swap(version: int, error: BaseException) -> str:
    """Why an engine is damaged: the swap after ``version`` failed with ``error`` part way."""
    return f"the swap after version {version} failed: {type(error).__name__}: {error}"


class GenerationInterrupted(Exception):
    """A generation was stopped part way (new weights are coming in and it will be sampled again)."""


class GenerationCall:
    """One attempt of a Generate call, registered with the gate while it runs."""

    def __init__(self) -> None:
        self.interrupted = False  # set by a restarting swap (or a failed keep swap); read by the engine between
        # token steps (any thread)
        self.dropped = False  # it stopped on the interrupt (rather than finishing just before it)
        self.abandoned = False  # its Generate call was cancelled (the client gone, its deadline passed)
        self._stop = asyncio.Event()

    def interrupt(self) -> None:
        self.interrupted = True
        self._stop.set()

    def abandon(self) -> None:
        self.abandoned = True

    def should_stop(self) -> bool:
        """Whether work on a thread, which cancelling the call does not reach, should stop at its next step
        (GenerationInterrupted): interrupted by a swap, or abandoned."""
        return self.interrupted or self.abandoned

    async def unless_interrupted(self, work: Awaitable[Result]) -> Result:
        """``work``'s result; if the call is interrupted first, ``work`` is cancelled and GenerationInterrupted
        raised."""
        work, stop = asyncio.ensure_future(work), asyncio.ensure_future(self._stop.wait())
        try:
            await asyncio.wait([work, stop], return_when=asyncio.FIRST_COMPLETED)
        finally:  # interrupted, or the caller cancelled: the work goes too
            stop.cancel()
            dropped = not work.done()
            if dropped:
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
        # (a cancelled gather ends with a CancelledError set as its exception, not as cancelled: ask whether the
        # work was dropped here, not how it ended)
        if dropped:
            raise GenerationInterrupted
        return work.result()


class SwapGate:
    """A weight swap holds new Generate calls back until it is done; the calls in flight finish first
    (``finish``), or are interrupted (``restart``: an interrupted call drops its work, waits for the swap to end
    and runs again from scratch under the new weights), or go on (``keep``: the engine holds them while it swaps
    the weights in, in the body of the ``with``; should the swap fail, they are interrupted as under
    ``restart``, so that no call goes on over weights that are not one version).

    The gate's state changes only between awaits, and every change that must be undone is undone in a
    ``finally`` without awaiting: a call or a swap cancelled at any point (a client gone, a deadline passed)
    leaves the gate as it found it."""

    def __init__(self) -> None:
        self._calls: set[GenerationCall] = set()
        self._swapping = False
        self._changed = asyncio.Event()  # set (and replaced) at each change: wakes whoever waits for one

    @property
    def generating(self) -> int:
        """Calls in flight."""
        return len(self._calls)

    async def run(self, attempt: Callable[[GenerationCall], Awaitable[Result]]) -> Result:
        """``attempt(call)`` outside any swap, again each time a swap interrupts it (it then raises
        GenerationInterrupted, or ``call.unless_interrupted`` raises it). A cancelled run abandons its call
        (``call.abandoned``), for work the cancellation does not reach (on a thread)."""
        while True:
            call = GenerationCall()
            await self._until(lambda: not self._swapping)
            self._calls.add(call)
            try:
                return await attempt(call)
            except GenerationInterrupted:
                if not call.interrupted:
                    raise
                call.dropped = True
            except asyncio.CancelledError:
                call.abandon()
                raise
            finally:
                self._calls.discard(call)
                self._changed_now()

    @contextlib.asynccontextmanager
    async def swap(self, partial_rollout: PartialRollout = "finish"):
        """Hold new calls back for the body of the ``with``; before it, finish or interrupt the calls in flight
        (``finish``, ``restart``), or leave them to the body (``keep``)."""
        await self._until(lambda: not self._swapping)
        self._swapping = True
        try:
            if partial_rollout == "keep":
                try:
                    yield
                except BaseException:  # a failed or cancelled swap: no call goes on over what it left
                    for call in list(self._calls):
                        call.interrupt()
                    raise
                return
            stopped = list(self._calls) if partial_rollout == "restart" else []
            for call in stopped:
                call.interrupt()
            await self._until(lambda: not self._calls)
            restarted = sum(call.dropped for call in stopped)
            if restarted:
                log.info("generate_calls_restarted", calls=restarted)
            yield
        finally:
            self._swapping = False
            self._changed_now()

    async def _until(self, condition: Callable[[], bool]) -> None:
        while not condition():
            await self._changed.wait()

    def _changed_now(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()
