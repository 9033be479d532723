"""CPU tests of the SwapGate in services/rollout/swap.py: Generate calls and weight swaps, in one event loop.

A "model" here is a version number that a swap changes; an attempt reads it when it starts and returns it when
its work is done, as an engine stamps its samples."""

from __future__ import annotations

import asyncio
import time

import pytest
from structlog.testing import capture_logs

from services.rollout.swap import GenerationCall, GenerationInterrupted, SwapGate


class Model:
    def __init__(self) -> None:
        self.version = 0
        self.attempts = 0  # attempts started
        self.started = asyncio.Event()  # set when an attempt starts
        self.release = asyncio.Event()  # the work of every attempt ends once this is set
        self.cancelled = 0  # async work cancelled by an interrupt

    async def async_attempt(self, call: GenerationCall) -> int:
        """As the vLLM engine: async work, one request per prompt gathered, cancelled on an interrupt."""
        version = self._start()

        async def request() -> int:
            try:
                await self.release.wait()
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
            return version

        return (await call.unless_interrupted(asyncio.gather(request(), request())))[0]

    async def thread_attempt(self, call: GenerationCall) -> int:
        """As the hf engine: work on a thread, which looks at ``call.interrupted`` between token steps."""
        version = self._start()

        def work() -> int:
            while not self.release.is_set():
                if call.interrupted:
                    raise GenerationInterrupted
                time.sleep(0.001)
            return version

        return await asyncio.to_thread(work)

    def _start(self) -> int:
        self.attempts += 1
        self.started.set()
        return self.version


async def swap_in(gate: SwapGate, model: Model, version: int, restart: bool) -> None:
    async with gate.swap(restart):
        await asyncio.sleep(0.02)  # loading the weights takes a while: nothing may start meanwhile
        model.version = version


async def test_finish_mode_waits_for_the_call_in_flight():
    gate, model = SwapGate(), Model()
    generating = asyncio.create_task(gate.run(model.async_attempt))
    await model.started.wait()
    swapping = asyncio.create_task(swap_in(gate, model, 1, restart=False))
    await asyncio.sleep(0.05)
    assert not swapping.done() and model.version == 0  # the swap waits for the call in flight
    model.release.set()
    assert await generating == 0  # it finished under the old weights, untouched
    await swapping
    assert model.version == 1 and model.attempts == 1 and model.cancelled == 0 and gate.generating == 0


@pytest.mark.parametrize("kind", ["async_attempt", "thread_attempt"])
async def test_restart_mode_interrupts_the_call_which_completes_under_the_new_version(kind):
    gate, model = SwapGate(), Model()
    generating = asyncio.create_task(gate.run(getattr(model, kind)))
    await model.started.wait()
    with capture_logs() as logs:
        await asyncio.wait_for(swap_in(gate, model, 1, restart=True), 5)  # no waiting for the call's work
    assert model.version == 1
    assert [e for e in logs if e["event"] == "generate_calls_restarted"] == [
        {"event": "generate_calls_restarted", "calls": 1, "log_level": "info"}]
    model.release.set()
    assert await generating == 1  # run again, whole, under the new weights (not during the swap: it saw 1)
    assert model.attempts == 2 and gate.generating == 0
    assert model.cancelled == (2 if kind == "async_attempt" else 0)


async def test_new_calls_wait_during_a_swap():
    gate, model = SwapGate(), Model()
    model.release.set()
    async with gate.swap(restart=True):  # nothing in flight: no restart, and in at once
        calling = asyncio.create_task(gate.run(model.async_attempt))
        await asyncio.sleep(0.05)
        assert not calling.done() and model.attempts == 0 and gate.generating == 0
        model.version = 1
    assert await calling == 1 and model.attempts == 1


async def test_calls_that_fail_or_are_cancelled_leave_the_gate():
    gate, model = SwapGate(), Model()

    async def failing(call: GenerationCall) -> int:
        raise ValueError("bad prompt")

    with pytest.raises(ValueError, match="bad prompt"):
        await gate.run(failing)
    cancelled = asyncio.create_task(gate.run(model.async_attempt))
    await model.started.wait()
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    assert gate.generating == 0 and model.cancelled == 2  # its work (both requests) went with it
    await asyncio.wait_for(swap_in(gate, model, 1, restart=False), 5)  # nothing left to wait for
    with pytest.raises(GenerationInterrupted):  # raised without an interrupt: an error, not a restart
        await gate.run(lambda call: asyncio.to_thread(_raise_interrupted))


def _raise_interrupted() -> int:
    raise GenerationInterrupted
