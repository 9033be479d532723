"""Wall time by stage: of a coordinator's step, of a weight sync."""

from __future__ import annotations

import time
from contextlib import contextmanager


class StageTimer:
    """Wall time of each stage of a step: ``with timer("gen"): ...`` -> timing_s/gen."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.started = time.perf_counter()

    @contextmanager
    def __call__(self, stage: str):
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[stage] = self.seconds.get(stage, 0.0) + time.perf_counter() - started

    async def timed(self, stage: str, awaitable):
        """Await ``awaitable``, recording its time as ``stage`` (for stages that run concurrently)."""
        with self(stage):
            return await awaitable

    def metrics(self) -> dict[str, float]:
        total = time.perf_counter() - self.started
        return {**{f"timing_s/{stage}": s for stage, s in self.seconds.items()}, "timing_s/step": total}
