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
  runs that far ahead; each batch keeps the sampler state from right after
  it was drawn, which is what a checkpoint of its step must record.
- The time the producer spends waiting is the rollout fleet's idle time.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, Generic, TypeVar

Batch = TypeVar("Batch")


@dataclass(frozen=True)
class Ahead(Generic[Batch]):
    """A step's batch, generated ahead of its training."""

    step: int
    batch: Batch
    data_state: dict  # the data sampler's state right after this batch was drawn


class Pipeline(Generic[Batch]):
    def __init__(self, produce: Callable[[int], Awaitable[Batch]], data_state: Callable[[], dict],
                 first_step: int, *, last_step: int, max_staleness: int):
        """``produce(step)`` generates and scores a step's batch; ``data_state()`` is the sampler's state now.
        ``produce`` must draw its batch before it awaits anything, so that the state read after it returns is the
        state right after its batch (the next batch is only begun after it returns)."""
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        self.produce, self.data_state = produce, data_state
        self.first_step, self.last_step, self.max_staleness = first_step, last_step, max_staleness
        self.completed = first_step - 1  # the last step whose update and sync are done
        self._ready: asyncio.Queue[Ahead[Batch]] = asyncio.Queue()
        self._changed = asyncio.Condition()
        self._task: asyncio.Task | None = None
        self._busy: list[tuple[float, float]] = []  # (start, end) of each produce call, and of the one running
        self._busy_since: float | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        for step in range(self.first_step, self.last_step + 1):
            async with self._changed:
                await self._changed.wait_for(lambda: self.completed >= step - 1 - self.max_staleness)  # noqa: B023 - called within this wait
            self._busy_since = time.perf_counter()
            batch = await self.produce(step)
            self._busy.append((self._busy_since, time.perf_counter()))
            self._busy_since = None
            await self._ready.put(Ahead(step, batch, self.data_state()))

    async def next(self, step: int) -> Ahead[Batch]:
        """The batch of ``step`` (waiting for it); the producer's failure, if it failed, is raised here."""
        if self._task is None:
            raise RuntimeError("the generation pipeline was not started")
        producing = self._task
        getting = asyncio.ensure_future(self._ready.get())
        await asyncio.wait({getting, producing}, return_when=asyncio.FIRST_COMPLETED)
        if not getting.done():
            getting.cancel()
            producing.result()  # raises what ended the producer
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

    def idle_fraction(self, since: float) -> float:
        """Share of the time from ``since`` (a time.perf_counter()) to now that the producer (the rollout
        fleet) was not generating or scoring."""
        now = time.perf_counter()
        spans = self._busy + ([(self._busy_since, now)] if self._busy_since is not None else [])
        busy = sum(max(0.0, min(end, now) - max(start, since)) for start, end in spans)
        return max(0.0, 1.0 - busy / (now - since)) if now > since else 0.0

    async def close(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
