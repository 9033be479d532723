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
    """Replicas of one kind that a batch is spread over; ``drop`` takes one out, also mid-batch.

    A shard fails over on a retryable gRPC failure, on ``Unavailable`` raised by ``call`` (a replica that
    answered but cannot be used, e.g. one serving other weights), and when its replica is dropped. It goes
    to the next replica that has not failed in the same batch (a dead one fails every call until the registry
    forgets it); only when all have failed does it try failed ones again, up to ``attempts`` tries in all
    (at least one per replica)."""

    def __init__(self, kind: str, replicas: Sequence[Replica], attempts: int = 3):
        if not replicas:
            raise Unavailable(f"no {kind} replica is up")
        self.kind, self.replicas, self.attempts = kind, list(replicas), attempts
        self._in_flight: list[tuple[Replica, asyncio.Task]] = []

    def drop(self, replica: Replica) -> None:
        """No further shard goes to ``replica``; the calls on it now are cancelled and their shards redone."""
        if replica in self.replicas:
            self.replicas.remove(replica)
        for on, task in self._in_flight:
            if on is replica:
                task.cancel()

    async def map_shards(
        self, count: int, call: Callable[[Replica, int, int], Awaitable[Result]]
    ) -> list[tuple[Result, Replica]]:
        """Run ``call(replica, lo, hi)`` on one shard per replica; a shard that fails is redone elsewhere.

        Returns (result, replica that produced it) per shard, in shard order.
        """
        bounds, failed = shard_bounds(count, len(self.replicas)), []
        shards = [asyncio.ensure_future(self._shard(index, lo, hi, call, failed))
                  for index, (lo, hi) in enumerate(bounds)]
        try:
            return list(await asyncio.gather(*shards))
        finally:  # a shard that failed for good fails the batch: the others' work would be thrown away
            for shard in shards:
                shard.cancel()

    async def _shard(self, index: int, lo: int, hi: int, call, failed: list[Replica]) -> tuple[Result, Replica]:
        last_error: BaseException | None = None
        attempts = max(self.attempts, len(self.replicas))
        for attempt in range(attempts):
            if not self.replicas:
                raise Unavailable(f"no {self.kind} replica left for shard [{lo}, {hi}) (last error: {last_error})")
            start = (index + attempt) % len(self.replicas)
            turn = self.replicas[start:] + self.replicas[:start]
            replica = next((r for r in turn if r not in failed), turn[0])
            running = (replica, asyncio.ensure_future(call(replica, lo, hi)))
            self._in_flight.append(running)
            try:
                return await running[1], replica
            except asyncio.CancelledError:
                if asyncio.current_task().cancelling():  # the batch itself is being cancelled
                    raise
                last_error = Unavailable(f"{self.kind} {getattr(replica, 'address', replica)} was dropped")
            except Exception as error:  # noqa: BLE001 - decided by is_retryable
                if not (is_retryable(error) or isinstance(error, Unavailable)):
                    raise
                last_error = error
            finally:
                self._in_flight.remove(running)
            failed.append(replica)
            log.warning("shard_failed", kind=self.kind, shard=index, attempt=attempt,
                        replica=getattr(replica, "address", "?"), error=str(last_error)[:300])
        raise Unavailable(f"{self.kind} shard [{lo}, {hi}) failed on {attempts} attempts: {last_error}")


async def map_shards_recovering(
    pool: Callable[[], ReplicaPool[Replica]], count: int, call: Callable[[Replica, int, int], Awaitable[Result]],
    attempts: int, recover: Callable[[Unavailable], Awaitable[None]],
) -> list[tuple[Result, Replica]]:
    """``pool().map_shards(count, call)``; when every replica fails it, ``await recover(failure)`` (which may put
    a new pool in place) and do the whole batch again, up to ``attempts`` times in all."""
    for _ in range(attempts - 1):
        try:
            return await pool().map_shards(count, call)
        except Unavailable as failure:
            await recover(failure)
    return await pool().map_shards(count, call)
