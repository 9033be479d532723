"""Spreading one batch over replicas, and redoing a failed shard on another replica."""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable, Generic, Sequence, TypeVar

import structlog

from services.common.errors import Unavailable
from services.common.rpc import is_retryable

log = structlog.get_logger()
Replica = TypeVar("Replica")
Result = TypeVar("Result")


def shard_bounds(count: int, shards: int) -> list[tuple[int, int]]:
    """Split range(count) into ``shards`` contiguous, near-equal, non-empty [lo, hi) ranges (none if count is 0)."""
    if count <= 0:
        return []
    shards = max(1, min(shards, count))
    base, extra = divmod(count, shards)
    bounds, lo = [], 0
    for index in range(shards):
        hi = lo + base + (1 if index < extra else 0)
        bounds.append((lo, hi))
        lo = hi
    return bounds


class ReplicaPool(Generic[Replica]):
    def __init__(self, kind: str, replicas: Sequence[Replica], attempts: int = 3):
        if not replicas:
            raise Unavailable(f"no {kind} replica is up")
        self.kind, self.replicas, self.attempts = kind, list(replicas), attempts

    async def map_shards(
        self, count: int, call: Callable[[Replica, int, int], Awaitable[Result]]
    ) -> list[tuple[Result, Replica]]:
        """Run ``call(replica, lo, hi)`` on one shard per replica; a shard that fails is redone elsewhere.

        Returns (result, replica that produced it) per shard, in shard order.
        """
        bounds = shard_bounds(count, len(self.replicas))
        return list(await asyncio.gather(*(self._shard(index, lo, hi, call) for index, (lo, hi) in enumerate(bounds))))

    async def _shard(self, index: int, lo: int, hi: int, call) -> tuple[Result, Replica]:
        last_error: BaseException | None = None
        for attempt in range(self.attempts):
            replica = self.replicas[(index + attempt) % len(self.replicas)]
            try:
                return await call(replica, lo, hi), replica
            except Exception as error:  # noqa: BLE001 - decided by is_retryable
                if not is_retryable(error):
                    raise
                last_error = error
                log.warning("shard_failed", kind=self.kind, shard=index, attempt=attempt,
                            replica=getattr(replica, "address", "?"), error=str(error)[:300])
        raise Unavailable(f"{self.kind} shard [{lo}, {hi}) failed on {self.attempts} attempts: {last_error}")
