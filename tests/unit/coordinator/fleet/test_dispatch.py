"""CPU tests of services/coordinator/fleet/dispatch.py: a batch spread over replicas, failed shards redone elsewhere."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest

from services.common.errors import Unavailable
from services.coordinator.fleet.dispatch import ReplicaPool, ReplicaSpeeds, map_shards_recovering, split_by_speed


@pytest.mark.parametrize(("count", "replicas", "shares"), [  # unmeasured: equal, the extra to the first
    (10, 3, [4, 3, 3]),
    (9, 3, [3, 3, 3]),
    (7, 1, [7]),
    (2, 5, [1, 1, 0, 0, 0]),
    (11, 4, [3, 3, 3, 2]),
    (0, 2, [0, 0]),
])
def test_equal_shares_until_measured(count, replicas, shares):
    assert split_by_speed(count, [None] * replicas) == shares


@pytest.mark.parametrize(("count", "speeds", "shares"), [
    (64, [3.0, 1.0], [48, 16]),
    (64, [1.0, 3.0], [16, 48]),
    (10, [1.0, 1.0, 1.0], [4, 3, 3]),  # 3.33 each: the one left over to the first
    (10, [2.0, 1.0], [7, 3]),  # 6.67 / 3.33: largest remainder
    (7, [1.0, 1.0, 2.0], [2, 2, 3]),  # 1.75 / 1.75 / 3.5: the two .75s win over .5
    (64, [100.0, 1.0], [61, 3]),  # 63.4 / 0.6: the slow one is raised to 10% of its equal 32 (3)
    (64, [100.0, 1.0, 1.0], [60, 2, 2]),  # floor int(0.1 * 64 / 3) = 2 each
    (3, [100.0, 1.0, 1.0], [1, 1, 1]),  # as many items as replicas: one each
    (2, [1.0, 5.0, 3.0], [0, 1, 1]),  # fewer: the fastest take them
    (64, [3.0, None], [32, 32]),  # unmeasured counts as the mean of the measured (3)
    (64, [3.0, 1.0, None], [32, 11, 21]),  # None as 2: 32 / 10.67 / 21.33
])
def test_shares_follow_speeds_by_hand(count, speeds, shares):
    got = split_by_speed(count, speeds)
    assert got == shares and sum(got) == count


def test_rounding_keeps_the_total_and_the_floor():
    for count in range(0, 200, 7):
        for speeds in ([1.0, 2.0, 3.0], [1e-6, 1.0, 1e6, 7.5], [0.3] * 5):
            shares = split_by_speed(count, speeds)
            assert sum(shares) == count, (count, speeds)
            if count >= len(speeds):
                assert min(shares) >= max(1, int(0.1 * count / len(speeds))), (count, speeds, shares)


def test_speed_is_a_moving_average_of_the_calls():
    speeds = ReplicaSpeeds()
    assert speeds.of("a") is None
    speeds.record("a", 100, 2.0)  # 50 tokens/s
    assert speeds.of("a") == 50.0
    speeds.record("a", 100, 1.0)  # 100: half of each
    assert speeds.of("a") == 75.0
    speeds.record("a", 0, 1.0)  # no tokens: nothing measured
    speeds.record("b", 10, 0.0)
    assert speeds.of("a") == 75.0 and speeds.of("b") is None
    speeds.forget("a")
    assert speeds.of("a") is None


@dataclass
class FakeReplica:
    address: str
    fail_with: type[BaseException] | None = None
    calls: list[tuple[int, int]] = field(default_factory=list)


def make_call(processed: list[int]):
    async def call(replica: FakeReplica, lo: int, hi: int):
        replica.calls.append((lo, hi))
        await asyncio.sleep(0.001 * (3 - lo % 3))  # shards finish out of order
        if replica.fail_with is not None:
            raise replica.fail_with(f"{replica.address} is down")
        processed.extend(range(lo, hi))
        return [f"{replica.address}:{i}" for i in range(lo, hi)]

    return call


async def test_map_shards_all_healthy_in_shard_order():
    replicas = [FakeReplica("a"), FakeReplica("b"), FakeReplica("c")]
    processed: list[int] = []
    results = await ReplicaPool("rollout", replicas).map_shards(8, make_call(processed))
    assert [r.address for _, r in results] == ["a", "b", "c"]
    assert [item for items, _ in results for item in items] == [
        "a:0", "a:1", "a:2", "b:3", "b:4", "b:5", "c:6", "c:7"]
    assert sorted(processed) == list(range(8))


async def test_failed_shard_is_redone_on_the_next_replica():
    replicas = [FakeReplica("a"), FakeReplica("b", fail_with=ConnectionError), FakeReplica("c")]
    processed: list[int] = []
    results = await ReplicaPool("rollout", replicas).map_shards(9, make_call(processed))
    assert [r.address for _, r in results] == ["a", "c", "c"]  # b's shard went to c
    assert [item for items, _ in results for item in items] == [
        "a:0", "a:1", "a:2", "c:3", "c:4", "c:5", "c:6", "c:7", "c:8"]
    assert sorted(processed) == list(range(9))  # every item exactly once
    assert replicas[1].calls == [(3, 6)]
    assert sorted(replicas[2].calls) == [(3, 6), (6, 9)]


async def test_shards_sized_by_speed_and_a_failed_ones_redone_whole_elsewhere():
    speeds = {"a": 3.0, "b": 1.0, "c": None}  # c not yet measured: as the mean, 2
    replicas = [FakeReplica("a"), FakeReplica("b", fail_with=ConnectionError), FakeReplica("c")]
    processed: list[int] = []
    pool = ReplicaPool("rollout", replicas, speed=lambda replica: speeds[replica.address])
    results = await pool.map_shards(12, make_call(processed))
    assert replicas[0].calls == [(0, 6)] and replicas[1].calls == [(6, 8)]  # 6 / 2 / 4 of 12
    assert sorted(replicas[2].calls) == [(6, 8), (8, 12)]  # b's share, redone on c
    assert [r.address for _, r in results] == ["a", "c", "c"]
    assert sorted(processed) == list(range(12))  # every item exactly once


async def test_a_replica_with_an_empty_share_is_not_called():
    replicas = [FakeReplica("a"), FakeReplica("b"), FakeReplica("c")]
    processed: list[int] = []
    results = await ReplicaPool("rollout", replicas, speed=lambda r: {"a": 1.0, "b": 9.0, "c": 5.0}[r.address]
                                ).map_shards(2, make_call(processed))
    assert [r.address for _, r in results] == ["b", "c"] and replicas[0].calls == []
    assert sorted(processed) == [0, 1]


async def test_timeout_is_retried_too_and_wraps_around():
    replicas = [FakeReplica("a"), FakeReplica("b", fail_with=TimeoutError), FakeReplica("c", fail_with=TimeoutError)]
    processed: list[int] = []
    results = await ReplicaPool("rollout", replicas).map_shards(3, make_call(processed))
    assert [r.address for _, r in results] == ["a", "a", "a"]  # c's shard goes to a (wrapping), b's to c then a
    assert sorted(processed) == [0, 1, 2]


async def test_non_retryable_error_propagates():
    replicas = [FakeReplica("a"), FakeReplica("b", fail_with=ValueError)]
    with pytest.raises(ValueError, match=r"b is down"):
        await ReplicaPool("rollout", replicas).map_shards(4, make_call([]))
    await asyncio.sleep(0.01)  # let a's shard finish
    assert replicas[0].calls == [(0, 2)]  # b's shard is not retried elsewhere


async def test_a_shard_failing_for_good_cancels_the_others():
    cancelled = []

    async def call(replica: FakeReplica, lo: int, hi: int):
        if replica.address == "b":
            raise ValueError("b refuses")
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.append(replica.address)
            raise

    with pytest.raises(ValueError, match="b refuses"):
        await ReplicaPool("rollout", [FakeReplica("a"), FakeReplica("b")]).map_shards(4, call)
    await asyncio.sleep(0)
    assert cancelled == ["a"]  # its result would be thrown away


async def test_all_replicas_failing_raises_unavailable():
    replicas = [FakeReplica(name, fail_with=ConnectionError) for name in "ab"]
    with pytest.raises(Unavailable, match=r"^rollout shard \[[02], [24]\) failed on 3 attempts: [ab] is down$"):
        await ReplicaPool("rollout", replicas).map_shards(4, make_call([]))


async def test_a_batch_every_replica_failed_is_done_again_after_each_recovery_until_the_attempts_run_out():
    pools = [ReplicaPool("rollout", [FakeReplica(name, fail_with=ConnectionError) for name in "ab"])]
    recovered = []

    async def recover(failure: Unavailable) -> None:  # the next pool: still dead, then one that answers
        recovered.append(str(failure))
        still_dead = len(recovered) == 1
        pools.append(ReplicaPool("rollout", [FakeReplica("c", fail_with=ConnectionError) if still_dead
                                             else FakeReplica("d")]))

    processed: list[int] = []
    results = await map_shards_recovering(lambda: pools[-1], 4, make_call(processed), attempts=3, recover=recover)
    assert [r.address for _, r in results] == ["d"]
    assert sorted(processed) == [0, 1, 2, 3]
    assert len(recovered) == 2 and all("is down" in failure for failure in recovered)

    pools[:] = [ReplicaPool("rollout", [FakeReplica("e", fail_with=ConnectionError)])]
    with pytest.raises(Unavailable, match=r"e is down"):
        await map_shards_recovering(lambda: pools[0], 4, make_call([]), attempts=2, recover=recover)
    assert len(recovered) == 3  # one recovery between the two attempts, none after the last


async def test_shards_skip_replicas_that_failed_in_the_batch_until_a_live_one_is_found():
    # three dead of four (killed, still registered): each dead one's shard finds the live one
    replicas = [FakeReplica("a")] + [FakeReplica(name, fail_with=ConnectionError) for name in "bcd"]
    processed: list[int] = []
    results = await ReplicaPool("reward", replicas).map_shards(8, make_call(processed))
    assert [r.address for _, r in results] == ["a"] * 4
    assert sorted(processed) == list(range(8))
    assert all(len(r.calls) <= 3 for r in replicas[1:])  # no dead replica tried twice by one shard


async def test_replica_dropped_mid_batch_has_its_shard_redone_elsewhere():
    replicas = [FakeReplica("a"), FakeReplica("b")]
    processed: list[int] = []
    pool = ReplicaPool("rollout", replicas)
    fast = make_call(processed)

    async def call(replica: FakeReplica, lo: int, hi: int):
        if replica.address == "b":
            replica.calls.append((lo, hi))
            await asyncio.sleep(3600)  # stalled: only the drop below ends it
        return await fast(replica, lo, hi)

    batch = asyncio.ensure_future(pool.map_shards(6, call))
    await asyncio.sleep(0.05)
    pool.drop(replicas[1])
    results = await asyncio.wait_for(batch, 5)
    assert [r.address for _, r in results] == ["a", "a"]
    assert sorted(processed) == list(range(6))  # b's shard done once, on a
    assert replicas[1].calls == [(3, 6)] and pool.replicas == [replicas[0]]


async def test_call_refusing_a_replica_with_unavailable_fails_over():
    replicas = [FakeReplica("a", fail_with=Unavailable), FakeReplica("b")]
    processed: list[int] = []
    results = await ReplicaPool("rollout", replicas).map_shards(4, make_call(processed))
    assert [r.address for _, r in results] == ["b", "b"] and sorted(processed) == [0, 1, 2, 3]


async def test_every_replica_dropped_raises_unavailable():
    pool = ReplicaPool("rollout", [FakeReplica("a")])

    async def call(replica: FakeReplica, lo: int, hi: int):
        pool.drop(replica)
        raise ConnectionError("a is down")

    with pytest.raises(Unavailable, match=r"^no rollout replica left for shard \[0, 4\) \(last error: a is down\)$"):
        await pool.map_shards(4, call)


def test_empty_replica_list_raises_unavailable():
    with pytest.raises(Unavailable, match=r"no reward replica is up"):
        ReplicaPool("reward", [])
