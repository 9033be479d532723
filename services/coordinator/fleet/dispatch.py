"""Spreading one batch over replicas, in shards sized by their measured speeds, and redoing a failed shard on
another replica."""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable, Generic, Sequence, TypeVar

import structlog

from services.common.errors import Unavailable
from services.common.rpc import is_retryable

log = structlog.get_logger()
Replica = TypeVar("Replica")
Result = TypeVar("Result")


LEAST_SHARE = 0.1  # of an equal share: the least a replica is given, so that its speed keeps being measured
SPEED_SMOOTHING = 0.5  # weight of a replica's latest call in its measured speed


def split_by_speed(count: int, speeds: Sequence[float | None], least: float = LEAST_SHARE) -> list[int]:
    """How many of ``count`` items each replica takes, in proportion to its speed (any unit; None: not yet
    measured, counted as the mean of those measured, all equal while none is). Each takes at least ``least`` of
    an equal share, and at least one item when there are as many items as replicas; the rest goes by largest
    remainder, ties to the earlier replica, so the shares sum to ``count``."""
    if not speeds:
        return []
    measured = [s for s in speeds if s is not None]
    mean = sum(measured) / len(measured) if measured else 1.0
    weights = [mean if s is None else s for s in speeds]
    floor = max(1, int(least * count / len(speeds))) if count >= len(speeds) else 0
    ideal = _with_floor(count, weights, floor)
    shares = [int(x) for x in ideal]
    by_remainder = sorted(range(len(ideal)), key=lambda i: shares[i] - ideal[i])  # stable: ties to the earlier
    for i in by_remainder[:count - sum(shares)]:
        shares[i] += 1
    return shares


def _with_floor(count: int, weights: list[float], floor: int) -> list[float]:
    """``count`` split in proportion to ``weights`` (in fractions of an item), every part raised to at least ``floor``
    and what that takes shared among the others in proportion to their weights."""
    raised: set[int] = set()
    while True:
        free = [i for i in range(len(weights)) if i not in raised]
        left, total = count - floor * len(raised), sum(weights[i] for i in free)
        ideal = [float(floor) if i in raised else left * weights[i] / total if total > 0 else left / len(free)
                 for i in range(len(weights))]
        low = {i for i in free if ideal[i] < floor}
        if not low:
            return ideal
        raised |= low


class ReplicaSpeeds:
    """Each replica's speed (work per second) as an exponential moving average over its calls: the latest call
    weighs SPEED_SMOOTHING."""

    def __init__(self) -> None:
        self.speeds: dict[str, float] = {}

    def record(self, address: str, work: float, seconds: float) -> None:
        if work <= 0 or seconds <= 0:
            return  # nothing to measure a speed from
        speed, before = work / seconds, self.speeds.get(address)
        self.speeds[address] = speed if before is None else SPEED_SMOOTHING * speed + (1 - SPEED_SMOOTHING) * before

    def of(self, address: str) -> float | None:
        return self.speeds.get(address)

    def forget(self, address: str) -> None:
        self.speeds.pop(address, None)


class ReplicaPool(Generic[Replica]):
    """Replicas of one kind that a batch is spread over; ``drop`` takes one out, also mid-batch.

    A shard fails over on a retryable gRPC failure, on ``Unavailable`` raised by ``call`` (a replica that
    answered but cannot be used, e.g. one serving other weights), and when its replica is dropped. It goes
    to the next replica that has not failed in the same batch (a dead one fails every call until the registry
    forgets it); only when all have failed does it try failed ones again, up to ``attempts`` tries in all
    (at least one per replica). ``speed(replica)`` (None: not measured) sizes each replica's shard
    (``split_by_speed``); without it the shards are equal."""

    def __init__(self, kind: str, replicas: Sequence[Replica], attempts: int = 3,
                 *, speed: Callable[[Replica], float | None] = lambda replica: None):
        if not replicas:
            raise Unavailable(f"no {kind} replica is up")
        self.kind, self.replicas, self.attempts, self.speed = kind, list(replicas), attempts, speed
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
        """Run ``call(replica, lo, hi)`` on one contiguous shard per replica (none on a replica whose share is
        empty); a shard that fails is redone elsewhere.

        Returns (result, replica that produced it) per shard, in shard order.
        """
        if not self.replicas:
            raise Unavailable(f"no {self.kind} replica left for a batch of {count}")
        sizes = split_by_speed(count, [self.speed(r) for r in self.replicas])
        failed: list[Replica] = []
        shards: list[asyncio.Future[tuple[Result, Replica]]] = []
        for index, size in enumerate(sizes):  # shard ``index`` goes first to replica ``index``
            lo = sum(sizes[:index])
            if size:
                shards.append(asyncio.ensure_future(self._shard(index, lo=lo, hi=lo + size, call=call, failed=failed)))
        try:
            return list(await asyncio.gather(*shards))
        finally:  # a shard that failed for good fails the batch: the others' work would be thrown away
            for shard in shards:
                shard.cancel()

    async def _shard(self, index: int, lo: int, hi: int, *, call, failed: list[Replica]) -> tuple[Result, Replica]:
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
                task = asyncio.current_task()  # this coroutine's (it runs in a task)
                if task is not None and task.cancelling():  # the batch is being cancelled
                    raise
                last_error = Unavailable(f"{self.kind} {getattr(replica, 'address', replica)} was dropped")
            except Exception as error:  # decided by is_retryable
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
    *, attempts: int, recover: Callable[[Unavailable], Awaitable[None]],
) -> list[tuple[Result, Replica]]:
    """``pool().map_shards(count, call)``; when every replica fails it, ``await recover(failure)`` (which may put
    a new pool in place) and do the whole batch again, up to ``attempts`` times in all."""
    for _ in range(attempts - 1):
        try:
            return await pool().map_shards(count, call)
        except Unavailable as failure:
            await recover(failure)
    return await pool().map_shards(count, call)
