"""CPU tests of the coordinator's parts: registry, run store, shard dispatch and step metrics."""

from __future__ import annotations

import asyncio
import math
import sqlite3
import statistics
import time
from dataclasses import dataclass, field

import pytest
import torch

from services.common.errors import Unavailable
from services.common.timing import StageTimer
from services.coordinator.dispatch import ReplicaPool, map_shards_recovering, shard_bounds
from services.coordinator.metrics import data_metrics, mismatch_metrics, summary
from services.common.config import validate
from services.common.run_config import RunConfig
from services.coordinator.clients import Received
from services.coordinator.registry import Registry, ServiceRecord
from services.coordinator.rollout_set import RolloutSet, channel_backend
from services.coordinator.settings import rollout_set_settings
from services.coordinator.store import RunStore

# ---------------------------------------------------------------------------
# registry


def record(service_id: str, kind: str = "rollout", address: str = "", group: str = "default") -> ServiceRecord:
    return ServiceRecord(service_id, kind, address or f"host:{service_id}", group, protocol_version=1, last_seen=0.0)


def test_register_then_up_and_heartbeat_of_unknown_is_false():
    registry = Registry(heartbeat_interval_s=10, misses=3)
    registry.register(record("r1"))
    (up,) = registry.up("rollout")
    assert up.service_id == "r1" and up.last_seen > 0  # last_seen is set by the registry, not the caller
    assert registry.heartbeat("r1") is True
    assert registry.heartbeat("nobody") is False
    registry.deregister("r1")
    registry.deregister("r1")  # twice is harmless
    assert registry.up("rollout") == [] and registry.heartbeat("r1") is False


def test_service_is_down_after_interval_times_misses_and_back_after_a_heartbeat():
    registry = Registry(heartbeat_interval_s=0.1, misses=3)  # down after 0.3 s
    registry.register(record("r1"))
    registry.register(record("r2"))
    assert registry.down_after_s == pytest.approx(0.3)
    time.sleep(0.2)
    registry.heartbeat("r2")
    assert [r.service_id for r in registry.up("rollout")] == ["r1", "r2"]
    time.sleep(0.2)  # r1 last seen 0.4 s ago, r2 0.2 s ago
    assert [r.service_id for r in registry.up("rollout")] == ["r2"]
    assert len(registry.all()) == 2  # down is not forgotten
    assert registry.heartbeat("r1") is True
    assert [r.service_id for r in registry.up("rollout")] == ["r1", "r2"]
    time.sleep(0.35)
    assert registry.up("rollout") == []


def test_re_register_at_same_address_replaces_the_old_id():
    registry = Registry(heartbeat_interval_s=10, misses=3)
    registry.register(record("old", address="10.0.0.1:5000"))
    registry.register(record("other", address="10.0.0.2:5000"))
    registry.register(record("new", address="10.0.0.1:5000"))  # the service restarted
    assert sorted(r.service_id for r in registry.all()) == ["new", "other"]
    assert registry.heartbeat("old") is False
    registry.register(record("new", address="10.0.0.3:5000"))  # same id, moved: one entry
    assert sorted((r.service_id, r.address) for r in registry.all()) == [("new", "10.0.0.3:5000"),
                                                                         ("other", "10.0.0.2:5000")]


def test_up_filters_kind_and_group_in_a_stable_order():
    registry = Registry(heartbeat_interval_s=10, misses=3)
    for service in [record("b", "rollout", "h:2", "g1"), record("a", "rollout", "h:1", "g2"),
                    record("t", "trainer", "h:3", "g1"), record("c", "rollout", "h:0", "g1")]:
        registry.register(service)
    assert [r.service_id for r in registry.up("rollout")] == ["c", "a", "b"]  # by address
    assert [r.service_id for r in registry.up("rollout", "g1")] == ["c", "b"]
    assert [r.service_id for r in registry.up("trainer", "g2")] == []
    assert [r.service_id for r in registry.up("reward")] == []


# ---------------------------------------------------------------------------
# store


@pytest.fixture
def db_path(tmp_path):
    return tmp_path / "state" / "runs.sqlite"  # the folder does not exist yet


def test_create_and_get_run(db_path):
    store = RunStore(db_path)
    store.create_run("r1", "first", "data: {}\n", "/runs/r1", total_steps=10)
    run = store.get_run("r1")
    assert (run.run_id, run.name, run.state, run.config_yaml, run.run_dir, run.step, run.total_steps, run.error) == (
        "r1", "first", "pending", "data: {}\n", "/runs/r1", 0, 10, "")
    with pytest.raises(LookupError):
        store.get_run("nope")
    store.close()


def test_set_state_emits_an_event(db_path):
    store = RunStore(db_path)
    store.create_run("r1", "first", "", "/d", 10)
    store.record_step("r1", 3, {"loss": 0.5})
    event = store.set_state("r1", "failed", "trainer down")
    assert (event.run_id, event.kind, event.step, event.state, event.message, event.metrics) == (
        "r1", "state", 3, "failed", "trainer down", {})
    run = store.get_run("r1")
    assert (run.state, run.error) == ("failed", "trainer down")
    assert store.events_after("r1", 0)[-1] == event
    with pytest.raises(LookupError):
        store.set_state("ghost", "running")
    store.close()


def test_steps_metrics_and_events_in_order(db_path):
    store = RunStore(db_path)
    store.create_run("r1", "first", "", "/d", 10)
    store.create_run("r2", "second", "", "/d", 10)
    assert store.last_step_metrics("r1") == {} and store.step_metrics("r1") == []
    e1 = store.set_state("r1", "running")
    e2 = store.record_step("r1", 2, {"loss": 2.0})
    store.record_step("r2", 1, {"loss": 9.0})
    e3 = store.record_step("r1", 1, {"loss": 1.0, "score": 0.25})
    e4 = store.add_event("r1", "log", 1, "", "hello", {})
    store.record_step("r1", 2, {"loss": 1.5})  # a redone step replaces the old metrics

    assert store.step_metrics("r1") == [(1, {"loss": 1.0, "score": 0.25}), (2, {"loss": 1.5})]
    assert store.last_step_metrics("r1") == {"loss": 1.5}
    assert store.get_run("r1").step == 2
    events = store.events_after("r1", 0)
    assert [e.id for e in events] == sorted(e.id for e in events)
    assert events[:4] == [e1, e2, e3, e4]
    assert [(e.kind, e.step) for e in events] == [("state", 0), ("step", 2), ("step", 1), ("log", 1), ("step", 2)]
    assert store.events_after("r1", e3.id) == events[3:]
    assert store.events_after("r1", events[-1].id) == []
    assert [e.kind for e in store.events_after("r2", 0)] == ["step"]
    store.close()


def test_data_survives_closing_and_reopening(db_path):
    store = RunStore(db_path)
    store.create_run("r1", "first", "cfg", "/d", 10)
    store.set_state("r1", "running")
    store.record_step("r1", 1, {"loss": 1.0})
    before = store.events_after("r1", 0)
    store.close()

    store = RunStore(db_path)
    assert store.get_run("r1").state == "running" and store.get_run("r1").step == 1
    assert store.step_metrics("r1") == [(1, {"loss": 1.0})]
    assert store.events_after("r1", 0) == before
    assert store.add_event("r1", "log", 1, "", "again", {}).id > before[-1].id  # ids keep growing
    assert [r.run_id for r in store.list_runs()] == ["r1"]
    store.close()


def test_list_runs_in_creation_order(db_path):
    store = RunStore(db_path)
    for run_id in ("b", "a", "c"):
        store.create_run(run_id, run_id, "", "/d", 1)
    assert [r.run_id for r in store.list_runs()] == ["b", "a", "c"]
    with pytest.raises(sqlite3.IntegrityError):  # run ids are unique
        store.create_run("a", "again", "", "/d", 1)
    store.close()


# ---------------------------------------------------------------------------
# dispatch


@pytest.mark.parametrize(("count", "shards", "bounds"), [
    (10, 3, [(0, 4), (4, 7), (7, 10)]),
    (9, 3, [(0, 3), (3, 6), (6, 9)]),
    (7, 1, [(0, 7)]),
    (2, 5, [(0, 1), (1, 2)]),
    (1, 4, [(0, 1)]),
    (5, 0, [(0, 5)]),
    (11, 4, [(0, 3), (3, 6), (6, 9), (9, 11)]),
])
def test_shard_bounds_by_hand(count, shards, bounds):
    assert shard_bounds(count, shards) == bounds


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
    results = await map_shards_recovering(lambda: pools[-1], 4, make_call(processed), 3, recover)
    assert [r.address for _, r in results] == ["d"]
    assert sorted(processed) == [0, 1, 2, 3]
    assert len(recovered) == 2 and all("is down" in failure for failure in recovered)

    pools[:] = [ReplicaPool("rollout", [FakeReplica("e", fail_with=ConnectionError)])]
    with pytest.raises(Unavailable, match=r"e is down"):
        await map_shards_recovering(lambda: pools[0], 4, make_call([]), 2, recover)
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


# ---------------------------------------------------------------------------
# metrics


def test_summary_by_hand():
    assert summary("x", torch.tensor([1, 2, 6])) == {"x/mean": 3.0, "x/max": 6.0, "x/min": 1.0}
    assert summary("x", torch.tensor([], dtype=torch.int64)) == {"x/mean": 0.0, "x/max": 0.0, "x/min": 0.0}
    assert summary("y", torch.tensor([True, False, False, True])) == {"y/mean": 0.5, "y/max": 1.0, "y/min": 0.0}


def test_data_metrics_by_hand():
    # two sequences: 2 tokens and 1 token
    metrics = data_metrics(
        scores=torch.tensor([1.0, 0.0]),
        rewards=torch.tensor([0.0, 1.0, -0.5]),  # sequence sums: 1.0 and -0.5
        advantages=torch.tensor([0.5, -1.5, 1.0]),
        returns=torch.tensor([2.0, 1.0, 0.0]),
        values=torch.tensor([1.0, 1.0, 0.0]),
        response_lens=torch.tensor([2, 1]),
        prompt_lens=torch.tensor([4, 6]),
        truncated=torch.tensor([False, True]),
        rollout_logprobs=torch.log(torch.tensor([0.5, 0.25, 0.9])),
        old_logprobs=torch.log(torch.tensor([0.4, 0.25, 0.6])),
    )
    expected = {
        "critic/score/mean": 0.5, "critic/score/max": 1.0, "critic/score/min": 0.0,
        "critic/rewards/mean": 0.25, "critic/rewards/max": 1.0, "critic/rewards/min": -0.5,
        "critic/advantages/mean": 0.0, "critic/advantages/max": 1.0, "critic/advantages/min": -1.5,
        "critic/returns/mean": 1.0, "critic/returns/max": 2.0, "critic/returns/min": 0.0,
        "critic/values/mean": 2 / 3, "critic/values/max": 1.0, "critic/values/min": 0.0,
        # returns - values = [1, 0, 0]: unbiased var 1/3; var(returns) = 1 -> 1 - (1/3) / 1
        "critic/vf_explained_var": 2 / 3,
        "response_length/mean": 1.5, "response_length/max": 2.0, "response_length/min": 1.0,
        "response_length/clip_ratio": 0.5,
        "prompt_length/mean": 5.0, "prompt_length/max": 6.0, "prompt_length/min": 4.0,
        # |0.5 - 0.4| = 0.1, |0.25 - 0.25| = 0, |0.9 - 0.6| = 0.3; unbiased var (0.01 + 0.09 - 3 (0.4/3)^2) / 2 = 7/300
        "training/rollout_probs_diff_mean": (0.1 + 0.0 + 0.3) / 3,
        "training/rollout_probs_diff_max": 0.3,
        "training/rollout_probs_diff_std": math.sqrt(7 / 300),
        # centred rollout probs [-1, -6, 7] / 20, old probs [-1, -10, 11] / 60:
        # sum of products 138 / 1200, sums of squares 86 / 400 and 222 / 3600 -> 138 / sqrt(86 * 222)
        "training/rollout_actor_probs_pearson_corr": 138 / math.sqrt(86 * 222),
        # ratios pi_old / pi_rollout r = [0.8, 1, 2/3]; k3 = r - ln r - 1, summed: 37/15 - 3 - ln(0.8 * 2/3)
        "training/rollout_mismatch_kl": (-8 / 15 - math.log(8 / 15)) / 3,
        "training/rollout_is_ratio/mean": (0.8 + 1 + 2 / 3) / 3, "training/rollout_is_ratio/max": 1.0,
        "training/rollout_is_ratio/min": 2 / 3,
        # per response: 0.8 * 1 and 2/3
        "training/rollout_is_seq_ratio/mean": (0.8 + 2 / 3) / 2, "training/rollout_is_seq_ratio/max": 0.8,
        "training/rollout_is_seq_ratio/min": 2 / 3,
    }
    assert metrics.keys() == expected.keys()
    for key, value in expected.items():
        assert metrics[key] == pytest.approx(value, abs=1e-6), key


def test_data_metrics_of_an_empty_step_are_zero():
    empty, lengths = torch.tensor([]), torch.tensor([], dtype=torch.int64)
    metrics = data_metrics(empty, empty, empty, empty, None, lengths, lengths, torch.tensor([], dtype=torch.bool),
                           empty, empty)
    assert all(value == 0.0 and not math.isnan(value) for value in metrics.values())


def test_mismatch_metrics_random_against_independent_reference():
    generator = torch.Generator().manual_seed(5)
    lengths = torch.tensor([3, 0, 5, 1, 4])
    rollout = -torch.rand(13, generator=generator, dtype=torch.float64) * 3
    old = rollout + 0.3 * torch.randn(13, generator=generator, dtype=torch.float64)
    metrics = mismatch_metrics(rollout, old, lengths)
    p_rollout, p_old = [math.exp(v) for v in rollout.tolist()], [math.exp(v) for v in old.tolist()]
    diffs = [abs(a - b) for a, b in zip(p_rollout, p_old)]
    ratios = [b / a for a, b in zip(p_rollout, p_old)]
    seq_ratios, start = [], 0
    for n in lengths.tolist():
        if n:
            seq_ratios.append(math.prod(ratios[start:start + n]))
        start += n
    expected = {
        "training/rollout_probs_diff_mean": statistics.fmean(diffs), "training/rollout_probs_diff_max": max(diffs),
        "training/rollout_probs_diff_std": statistics.stdev(diffs),
        "training/rollout_actor_probs_pearson_corr": statistics.correlation(p_rollout, p_old),
        "training/rollout_mismatch_kl": statistics.fmean(r - math.log(r) - 1 for r in ratios),
        "training/rollout_is_ratio/mean": statistics.fmean(ratios), "training/rollout_is_ratio/max": max(ratios),
        "training/rollout_is_ratio/min": min(ratios),
        "training/rollout_is_seq_ratio/mean": statistics.fmean(seq_ratios),
        "training/rollout_is_seq_ratio/max": max(seq_ratios), "training/rollout_is_seq_ratio/min": min(seq_ratios),
    }
    assert metrics.keys() == expected.keys()
    for key, value in expected.items():
        assert metrics[key] == pytest.approx(value, rel=1e-6, abs=1e-12), key  # summary() is fp32


def test_mismatch_metrics_of_identical_policies():
    logprobs = torch.log(torch.tensor([0.5, 0.25, 0.9, 0.1], dtype=torch.float64))
    metrics = mismatch_metrics(logprobs, logprobs.clone(), torch.tensor([1, 3]))
    assert metrics["training/rollout_probs_diff_max"] == 0.0 and metrics["training/rollout_mismatch_kl"] == 0.0
    assert metrics["training/rollout_actor_probs_pearson_corr"] == pytest.approx(1.0)
    assert all(metrics[f"training/rollout_is_{level}/{stat}"] == 1.0
               for level in ("ratio", "seq_ratio") for stat in ("mean", "max", "min"))
    # a single token: no spread, so no correlation
    one = mismatch_metrics(logprobs[:1], logprobs[:1], torch.tensor([1]))
    assert one["training/rollout_actor_probs_pearson_corr"] == 0.0


def test_stage_timer_adds_up_repeated_stages():
    timer = StageTimer()
    for _ in range(2):
        with timer("gen"):
            time.sleep(0.01)
    with pytest.raises(RuntimeError), timer("train"):
        raise RuntimeError("the stage fails; its time still counts")
    metrics = timer.metrics()
    assert metrics.keys() == {"timing_s/gen", "timing_s/train", "timing_s/step"}
    assert 0.02 <= metrics["timing_s/gen"] <= metrics["timing_s/step"]


def test_weight_channel_transport_follows_where_trainer_and_rollouts_sit():
    assert channel_backend("", {"r1:1": frozenset()}) == "gloo"  # a trainer on CPU
    assert channel_backend("GPU-a", {"r1:1": frozenset({"GPU-b"}), "r2:1": frozenset({"GPU-c", "GPU-d"})}) == "nccl"
    # colocated: NCCL refuses two ranks on one GPU, so the weights go over CUDA IPC
    assert channel_backend("GPU-a", {"r1:1": frozenset({"GPU-a"}), "r2:1": frozenset({"GPU-a", "GPU-b"})}) == "cuda_ipc"
    with pytest.raises(ValueError, match=r"rollouts r1:1 share the trainer's GPU .* but r2:1 do not"):
        channel_backend("GPU-a", {"r1:1": frozenset({"GPU-a"}), "r2:1": frozenset({"GPU-b"})})


# ---------------------------------------------------------------------------
# a weight sync that a member fails


class StuckTrainer:
    """A trainer whose broadcast waits for a member that never takes it (until the channel's deadline)."""

    def __init__(self):
        self.cancelled = asyncio.Event()

    async def broadcast_weights(self, channel_id, bucket_bytes, timeout):
        try:
            await asyncio.sleep(timeout)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        raise TimeoutError("broadcast from rank 0 did not finish")


class SyncingMember:
    """A rollout's side of a sync: it takes the weights (``fails`` None), or fails with ``fails`` after a moment;
    closing it ends its call in flight, as closing a gRPC channel does."""

    def __init__(self, address: str, fails: Exception | None = None):
        self.address, self.fails, self.closed = address, fails, asyncio.Event()

    async def receive_weights(self, channel_id, timeout, restart_in_flight=False):
        if self.fails is None:
            return Received(3, 0.01, 0.0)
        closing = asyncio.ensure_future(self.closed.wait())
        done, _ = await asyncio.wait({closing}, timeout=0.05)
        if done:
            raise asyncio.CancelledError
        closing.cancel()
        raise self.fails

    async def close(self):
        self.closed.set()


class Notices:
    def __init__(self):
        self.messages = []

    def log(self, message, kind="log"):
        self.messages.append(message)

    def waiting(self, reason):
        pass


def syncing(*members: SyncingMember) -> tuple[RolloutSet, StuckTrainer]:
    trainer = StuckTrainer()
    rollouts = RolloutSet("run", rollout_set_settings(validate(RunConfig, {})), trainer, lambda: [], Notices(), lambda: False)
    rollouts.members, rollouts.channel_id = list(members), "run-weights-1"
    return rollouts, trainer


async def test_a_member_failing_mid_sync_ends_the_wait_for_the_trainers_side():
    """The trainer's side would wait for the member until the channel's deadline (120 s): the sync fails at once,
    the trainer's call is cancelled (its broadcast is abandoned when the next channel is prepared)."""
    rollouts, trainer = syncing(SyncingMember("ok:1"), SyncingMember("bad:1", Unavailable("engine gone")))
    failure = await asyncio.wait_for(rollouts._broadcast(3), 5)
    assert trainer.cancelled.is_set()
    assert failure == ("weight sync of version 3 on channel run-weights-1 failed (a rollout's side: Unavailable: "
                       "engine gone); not serving it: bad:1")


async def test_a_member_leaving_mid_sync_is_named_as_the_cause():
    stopped = SyncingMember("stopped:1", Unavailable("no answer"))
    rollouts, trainer = syncing(SyncingMember("ok:1"), stopped)
    sync = asyncio.ensure_future(rollouts._broadcast(3))
    await asyncio.sleep(0.01)
    await rollouts.drop("stopped:1", "no heartbeat for 5 s")  # closes its client: its receive ends
    failure = await asyncio.wait_for(sync, 5)
    assert trainer.cancelled.is_set()
    assert failure == ("weight sync of version 3 on channel run-weights-1 failed (stopped:1 left the run while it "
                       "was on the wire); not serving it: stopped:1")
