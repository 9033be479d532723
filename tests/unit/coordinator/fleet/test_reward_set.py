"""CPU tests of services/coordinator/fleet/reward_set.py: a reward replica dropped mid-batch (it stopped heartbeating)."""

from __future__ import annotations

import asyncio

from services.coordinator.fleet.clients import RewardSample, ScoredSample
from services.coordinator.fleet.reward_set import RewardSet
from services.coordinator.fleet.targets import ServiceTarget

SAMPLES = [RewardSample(data_source="reverse", response=str(i), ground_truth=str(i), extra_info={}) for i in range(8)]


class Reward:
    """A reward service that scores (``stopped`` false), or never answers, as one under SIGSTOP."""

    def __init__(self, address: str, stopped: bool = False):
        self.address, self.stopped, self.scored = address, stopped, 0

    async def score(self, samples, timeout):
        if self.stopped:
            await asyncio.sleep(3600)
        self.scored += len(samples)
        return [ScoredSample(score=1.0, valid=True, error="") for _ in samples], self.address

    async def close(self):
        pass


class Notices:
    def __init__(self):
        self.messages, self.reasons = [], []

    def log(self, message, kind="log"):
        self.messages.append(message)

    def waiting(self, reason):
        self.reasons.append(reason)


def reward_set(services: dict[str, Reward], notices: Notices) -> RewardSet:
    up = lambda target: [a for a, s in services.items() if not s.stopped]  # noqa: E731 - the registry's view
    return RewardSet(ServiceTarget("group", "default"), up, notices, should_stop=lambda: False, timeout_s=60.0,
                     connect=services.__getitem__)


async def test_a_replica_dropped_mid_batch_has_its_shard_scored_on_the_other():
    services, notices = {"a:1": Reward("a:1"), "b:1": Reward("b:1")}, Notices()
    rewards = reward_set(services, notices)
    services["a:1"].stopped = True  # after the set took it: its shard of the batch hangs
    scoring = asyncio.ensure_future(rewards.score(SAMPLES, "step 3"))
    await asyncio.sleep(0.05)
    assert not scoring.done()
    await rewards.drop("a:1", "no heartbeat for 5 s")
    scored = await asyncio.wait_for(scoring, 5)
    assert scored.by_service == {"b:1": 8} and len(scored.scores) == 8
    assert notices.messages == ["reward a:1 left the run (no heartbeat for 5 s); its batches go to b:1"]
    assert rewards.addresses() == ["b:1"]


async def test_with_none_left_the_run_waits_naming_the_one_dropped_until_it_answers_again():
    services, notices = {"a:1": Reward("a:1")}, Notices()
    rewards = reward_set(services, notices)
    services["a:1"].stopped = True
    scoring = asyncio.ensure_future(rewards.score(SAMPLES, "step 3"))
    await asyncio.sleep(0.05)
    await rewards.drop("a:1", "no heartbeat for 5 s")
    await asyncio.sleep(0.05)
    assert not scoring.done()
    assert notices.reasons == ["no reward service of group default answers (a:1 left the run: no heartbeat for 5 s); "
                               "waiting for one to answer"]
    services["a:1"].stopped = False  # SIGCONT: it heartbeats and answers again
    scored = await asyncio.wait_for(scoring, 5)
    assert scored.by_service == {"a:1": 8} and notices.reasons[-1] is None and rewards.left == {}
