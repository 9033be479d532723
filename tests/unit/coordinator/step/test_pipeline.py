"""The asynchronous pipeline's ordering (services/coordinator/step/pipeline.py): what is generated when."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.coordinator.step.pipeline import Pipeline


async def drive(max_staleness: int, steps: int = 6, train_s: float = 0.02, generate_s: float = 0.01):
    """Run a pipeline over ``steps`` steps; returns the log of events in order."""
    events: list[tuple[str, int]] = []
    position = {"next": 0}

    async def produce(step: int) -> int:
        events.append(("generate", step))
        await asyncio.sleep(generate_s)
        position["next"] += 1
        return step * 10

    pipeline = Pipeline(produce, lambda: {"position": position["next"]}, 1, last_step=steps,
                        max_staleness=max_staleness)
    pipeline.start()
    try:
        for step in range(1, steps + 1):
            ahead = await pipeline.next(step)
            assert ahead.batch == step * 10
            assert ahead.data_state == {"position": step}  # the sampler right after this step's batch
            events.append(("train", step))
            await asyncio.sleep(train_s)
            await pipeline.complete(step)
    finally:
        await pipeline.close()
    return events


def begun_before_trained(events, generated: int, trained: int) -> bool:
    return events.index(("generate", generated)) < events.index(("train", trained))


async def test_staleness_zero_is_the_synchronous_order():
    events = await drive(0)
    assert events == [(kind, step) for step in range(1, 7) for kind in ("generate", "train")]


async def test_staleness_one_generates_the_next_batch_while_the_trainer_works():
    events = await drive(1)
    for step in range(2, 7):
        assert begun_before_trained(events, step, step - 1)  # generated during the previous step's training
        if step < 6:
            assert not begun_before_trained(events, step + 1, step - 1)  # but not two steps ahead
    # step s is begun only after step s - 2 completed: its weights are at most one update old when trained
    for step in range(3, 7):
        assert events.index(("generate", step)) > events.index(("train", step - 2))


@pytest.mark.parametrize("max_staleness", [0, 1, 2, 3])
async def test_no_batch_is_begun_before_step_s_minus_one_minus_k_completed(max_staleness):
    events = await drive(max_staleness, steps=8, train_s=0.01, generate_s=0.0)
    trained = [step for kind, step in events if kind == "train"]
    assert trained == list(range(1, 9))
    for step in range(1, 9):
        done_before = {s for kind, s in events[: events.index(("generate", step))] if kind == "train"}
        # every step up to s - 1 - K had been trained (and completed) before step s was begun
        assert set(range(1, step - max_staleness)) <= done_before
        assert len(done_before) <= step - 1  # nothing is trained before it is generated


async def test_a_failing_producer_is_raised_to_the_trainer():
    async def produce(step: int) -> int:
        if step == 2:
            raise ConnectionError("rollout gone")
        return step

    pipeline = Pipeline(produce, dict, 1, last_step=3, max_staleness=1)
    pipeline.start()
    assert (await pipeline.next(1)).batch == 1
    with pytest.raises(ConnectionError, match="rollout gone"):
        await pipeline.next(2)
    await pipeline.close()


async def test_the_idle_fraction_counts_the_time_the_producer_waits():
    pipeline = Pipeline(lambda step: asyncio.sleep(0.05, result=step), dict, 1, last_step=2, max_staleness=0)
    since = time.perf_counter()
    pipeline.start()
    await pipeline.next(1)
    await asyncio.sleep(0.05)  # the producer waits for step 1 to complete
    assert 0.3 < pipeline.idle_fraction(since) < 0.7  # busy about 50 ms of about 100
    await pipeline.complete(1)
    await asyncio.sleep(0.02)  # step 2 is being produced: counted as busy until now
    assert pipeline.idle_fraction(time.perf_counter() - 0.01) < 0.2
    await pipeline.close()
