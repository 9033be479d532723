"""The asynchronous pipeline: the scored batches of later steps are generated while the trainer works on the
current one, never from weights more than ``max_staleness`` updates old.

Choices:
- One producer task generates (and scores) the batch of each step in step
  order; the loop trains on them in the same order.
- The batch of step s is begun only once step s - 1 - K is complete (its
  update done and its weights synced to the rollouts). Its samples therefore
  come from weights that at most K updates separate from the weights it is
  trained at: staleness <= K by construction. K = 0 is the synchronous loop:
  step s is generated after step s - 1 is done, exactly as before.
- So at most K + 1 batches exist ahead of the trainer, and the data sampler
  runs that far ahead; each batch keeps the sampler state from before it,
  which is what a checkpoint of the step before it must record.
- The time the producer spends waiting is the rollout fleet's idle time.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, Generic, TypeVar

Generated = TypeVar("Generated")


@dataclass(frozen=True)
class Ahead(Generic[Generated]):
    """A step's batch, generated ahead of its training."""

    step: int
    batch: Generated
    data_state: dict  # the data sampler's state before this batch was drawn


class Pipeline(Generic[Generated]):
    def __init__(self, produce: Callable[[int], Awaitable[Generated]], data_state: Callable[[], dict],
                 first_step: int, last_step: int, max_staleness: int):
        """``produce(step)`` generates and scores a step's batch; ``data_state()`` is the sampler's state now."""
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        self.produce, self.data_state = produce, data_state
        self.first_step, self.last_step, self.max_staleness = first_step, last_step, max_staleness
        self.completed = first_step - 1  # the last step whose update and sync are done
        self._ready: asyncio.Queue[Ahead[Generated]] = asyncio.Queue()
        self._changed = asyncio.Condition()
        self._task: asyncio.Task | None = None
        self.busy_s = 0.0  # seconds the producer spent generating and scoring
        self.started = time.perf_counter()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        for step in range(self.first_step, self.last_step + 1):
            async with self._changed:
                await self._changed.wait_for(lambda: self.completed >= step - 1 - self.max_staleness)
            state = self.data_state()
            began = time.perf_counter()
            batch = await self.produce(step)
            self.busy_s += time.perf_counter() - began
            await self._ready.put(Ahead(step, batch, state))

    async def next(self, step: int) -> Ahead[Generated]:
        """The batch of ``step`` (waiting for it); the producer's failure, if it failed, is raised here."""
        getting = asyncio.ensure_future(self._ready.get())
        await asyncio.wait({getting, self._task}, return_when=asyncio.FIRST_COMPLETED)
        if not getting.done():
            getting.cancel()
            self._task.result()  # raises what ended the producer
            raise RuntimeError(f"the generation pipeline ended before step {step}")
        ahead = getting.result()
        if ahead.step != step:
            raise RuntimeError(f"pipeline out of order: step {step} got the batch of step {ahead.step}")
        return ahead

    async def complete(self, step: int) -> None:
        """Step ``step`` is updated and its weights are on the rollouts: later batches may be begun."""
        async with self._changed:
            self.completed = step
            self._changed.notify_all()

    def idle_fraction(self) -> float:
        """Share of the time since the start that the producer (the rollout fleet) was not generating."""
        elapsed = time.perf_counter() - self.started
        return max(0.0, 1.0 - self.busy_s / elapsed) if elapsed > 0 else 0.0

    async def close(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
