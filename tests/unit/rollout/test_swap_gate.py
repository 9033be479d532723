"""CPU tests of the SwapGate in services/rollout/swap.py: Generate calls and weight swaps, in one event loop.

A "model" here is a version number that a swap changes; an attempt reads it when it starts and returns it when
its work is done, as an engine stamps its samples (or, for ``keep``, the versions its work began and ended
under)."""

from __future__ import annotations

import asyncio
import itertools
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

    async def spanning_attempt(self, call: GenerationCall) -> tuple[int, int]:
        """As either engine under keep: work that reads the version when it begins and when it ends."""
        first = self._start()
        await call.unless_interrupted(self.release.wait())
        return first, self.version

    def _start(self) -> int:
        self.attempts += 1
        self.started.set()
        return self.version


async def swap_in(gate: SwapGate, model: Model, version: int, partial_rollout: str) -> None:
    async with gate.swap(partial_rollout):
        await asyncio.sleep(0.02)  # loading the weights takes a while: nothing may start meanwhile
        model.version = version


async def test_finish_mode_waits_for_the_call_in_flight():
    gate, model = SwapGate(), Model()
    generating = asyncio.create_task(gate.run(model.async_attempt))
    await model.started.wait()
    swapping = asyncio.create_task(swap_in(gate, model, 1, "finish"))
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
        await asyncio.wait_for(swap_in(gate, model, 1, "restart"), 5)  # no waiting for the call's work
    assert model.version == 1
    assert [e for e in logs if e["event"] == "generate_calls_restarted"] == [
        {"event": "generate_calls_restarted", "calls": 1, "log_level": "info"}]
    model.release.set()
    assert await generating == 1  # run again, whole, under the new weights (not during the swap: it saw 1)
    assert model.attempts == 2 and gate.generating == 0
    assert model.cancelled == (2 if kind == "async_attempt" else 0)


async def test_keep_mode_swaps_while_the_call_in_flight_goes_on_under_the_new_version():
    gate, model = SwapGate(), Model()
    generating = asyncio.create_task(gate.run(model.spanning_attempt))
    await model.started.wait()
    with capture_logs() as logs:
        await asyncio.wait_for(swap_in(gate, model, 1, "keep"), 5)  # no waiting for the call's work
    assert model.version == 1 and not generating.done() and gate.generating == 1
    model.release.set()
    assert await generating == (0, 1)  # begun under version 0, ended under 1: not run again
    assert model.attempts == 1 and not [e for e in logs if e["event"] == "generate_calls_restarted"]


async def test_a_keep_swap_that_fails_runs_the_calls_in_flight_again():
    """A swap that breaks off leaves the model between versions: no call in flight may go on over it."""
    gate, model = SwapGate(), Model()
    generating = asyncio.create_task(gate.run(model.spanning_attempt))
    await model.started.wait()
    with pytest.raises(ConnectionError, match="the trainer went away"):
        async with gate.swap("keep"):
            await asyncio.sleep(0)
            model.version = 1  # part of the weights swapped in
            raise ConnectionError("the trainer went away")
    await asyncio.wait_for(until(lambda: model.attempts == 2), 5)  # dropped, and run again once the swap was over
    model.release.set()
    assert await generating == (1, 1)
    assert gate.generating == 0


async def until(condition) -> None:
    while not condition():
        await asyncio.sleep(0.001)


@pytest.mark.parametrize("partial_rollout", ["restart", "keep"])
async def test_new_calls_wait_during_a_swap(partial_rollout):
    gate, model = SwapGate(), Model()
    model.release.set()
    async with gate.swap(partial_rollout):  # nothing in flight: no restart, and in at once
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
    await asyncio.wait_for(swap_in(gate, model, 1, "finish"), 5)  # nothing left to wait for
    with pytest.raises(GenerationInterrupted):  # raised without an interrupt: an error, not a restart
        await gate.run(lambda call: asyncio.to_thread(_raise_interrupted))


def _raise_interrupted() -> int:
    raise GenerationInterrupted


class Timeline:
    """Every wait a swap can meet, each a few event-loop turns long: a call in flight that an earlier swap waits
    for, a call that arrives during the earlier swap, then the swap under test (which waits for the earlier swap
    to end and for the second call to finish, or interrupts it, then applies for a few turns)."""

    TURNS = 3

    def __init__(self, gate: SwapGate):
        self.gate, self.tasks, self.applying, self.applied = gate, {}, False, False

    async def work(self, call: GenerationCall) -> None:
        async def turns() -> None:
            for _ in range(self.TURNS):
                await asyncio.sleep(0)

        await call.unless_interrupted(turns())

    async def earlier_swap(self) -> None:
        async with self.gate.swap():
            for _ in range(self.TURNS):
                await asyncio.sleep(0)

    async def swap_under_test(self, partial_rollout: str) -> None:
        async with self.gate.swap(partial_rollout):
            self.applying = True
            for _ in range(self.TURNS):
                await asyncio.sleep(0)
            self.applied = True

    async def start(self, partial_rollout: str) -> None:
        self.tasks["first call"] = asyncio.create_task(self.gate.run(self.work))
        await asyncio.sleep(0)
        self.tasks["earlier swap"] = asyncio.create_task(self.earlier_swap())
        await asyncio.sleep(0)
        self.tasks["second call"] = asyncio.create_task(self.gate.run(self.work))
        self.tasks["swap"] = asyncio.create_task(self.swap_under_test(partial_rollout))

    def phase(self) -> str:
        """Where the swap under test is, as seen from outside."""
        if not self.tasks["earlier swap"].done():
            return "behind the earlier swap"
        return "applying" if self.applying else "draining the calls"


@pytest.mark.parametrize("partial_rollout", ["finish", "restart", "keep"])
@pytest.mark.parametrize("cancelled", ["swap", "second call"])
async def test_a_task_cancelled_at_any_turn_leaves_the_gate_open(partial_rollout, cancelled):
    """Cancel one task (a ReceiveWeights' swap, or a Generate call) after 0, 1, 2, ... event-loop turns, until
    it finishes first: whatever it was waiting for then, Generate calls and swaps go on afterwards."""
    phases = set()
    for turns in itertools.count():
        gate = SwapGate()
        timeline = Timeline(gate)
        await timeline.start(partial_rollout)
        for _ in range(turns):
            await asyncio.sleep(0)
        victim = timeline.tasks[cancelled]
        if victim.done():
            break
        phases.add(timeline.phase())
        victim.cancel()
        await asyncio.wait_for(asyncio.gather(*timeline.tasks.values(), return_exceptions=True), 5)
        assert gate.generating == 0
        await asyncio.wait_for(gate.run(timeline.work), 5)  # a Generate call goes through
        await asyncio.wait_for(timeline.earlier_swap(), 5)  # and so does a swap
    # cancelled while it waited for the earlier swap, while the swap under test waited for the second call (or,
    # under keep, for its turn), and while the swap applied (a call then waits to run again, if the swap
    # interrupted it, or goes on beside it, under keep)
    applying = ["applying"] if cancelled == "swap" or partial_rollout != "finish" else []
    assert phases == {"behind the earlier swap", "draining the calls", *applying}
