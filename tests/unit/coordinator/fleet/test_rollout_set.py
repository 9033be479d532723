"""CPU tests of services/coordinator/fleet/rollout_set.py: a formation that a rollout refuses every time, and which
members sleep while the trainer works (the fakes are those of test_weight_channels.py)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.common.config import validate
from services.common.errors import Unavailable
from services.run.config import RunConfig
from services.coordinator.fleet.clients import Received, RolloutInfo, SyncResult, TrainerPlacement
from services.coordinator.fleet.rollout_set import RolloutSet
from services.coordinator.settings import rollout_set_settings
from services.coordinator.fleet.weight_channels import ChannelNotFormed
from tests.unit.coordinator.fleet.test_weight_channels import Notices, SyncingMember, refused


class JoiningTrainer:
    """The actor's side of a formation: it waits for the members until the channel's deadline."""

    async def placement(self, timeout=None):
        return TrainerPlacement(gpu="", ranks=1)

    async def prepare_channel(self, channel_id, backend, world_size, timeout, keep_joined=False):
        return b"127.0.0.1:1"

    async def join_channel(self, channel_id, backend, rendezvous, world_size, timeout):
        await asyncio.sleep(timeout)


class RefusingRollout:
    """A rollout that has the run loaded and answers, but refuses every JoinChannel with ``refusal``."""

    def __init__(self, address: str, refusal: BaseException):
        self.address, self.refusal, self.joins = address, refusal, 0

    async def info(self, timeout=None):
        return RolloutInfo(run_id="run", weight_version=0, channel_ranks=1)

    async def join_channel(self, channel_id, backend, rendezvous, rank, world_size, timeout):
        self.joins += 1
        raise self.refusal

    async def close(self):
        pass


@pytest.mark.parametrize("refusal, ending", [
    (refused(grpc.StatusCode.INTERNAL, "RuntimeError: CUDA error: out of memory"), ChannelNotFormed),
    (refused(grpc.StatusCode.UNAVAILABLE, "engine restarting"), Unavailable),
])
async def test_a_rollout_that_refuses_every_join_ends_the_formation_after_three(refusal, ending):
    """Not a wait for the trainer's side (the channel's deadline), nor formations without end: three, each an
    event, then the ending ``not_formed`` chose, naming the rollout's refusal."""
    rollout, notices = RefusingRollout("r:1", refusal), Notices()
    rollouts = RolloutSet("run", rollout_set_settings(validate(RunConfig, {})), actor=JoiningTrainer(),
                          find=lambda: ["r:1"], notices=notices, should_stop=lambda: False,
                          connect=lambda address: rollout)
    with pytest.raises(ending, match=r"could not be formed in 3 attempts; the first: rollout r:1 did not join "
                                     rf"\({refusal.code().name}: {refusal.details()}\)"):
        await asyncio.wait_for(rollouts.form(), 5)
    assert rollout.joins == 3 and sum("not formed" in message for message in notices.messages) == 3


class SendingTrainer:
    """A trainer that sends version 3 into whichever channel it is asked to."""

    def __init__(self):
        self.sent_on = []

    async def broadcast_weights(self, channel_id, bucket_bytes, timeout):
        self.sent_on.append(channel_id)
        return SyncResult(weight_version=3, total_bytes=1024, buckets=1, seconds=0.001)


class SleepingMember(SyncingMember):
    def __init__(self, address: str):
        super().__init__(address)
        self.calls = []

    async def sleep(self, timeout):
        self.calls.append("sleep")

    async def wake_up(self, timeout):
        self.calls.append("wake_up")


async def test_a_sync_reaches_every_channel_and_only_rollouts_on_the_trainers_device_sleep():
    """Every GPU generating: one rollout beside the trainer (its own channel, asleep while the trainer works),
    one on a GPU of its own that goes on."""
    beside, apart, trainer = SleepingMember("beside:1"), SleepingMember("apart:1"), SendingTrainer()
    rollouts = RolloutSet("run", rollout_set_settings(validate(RunConfig, {})), actor=trainer, find=lambda: [],
                          notices=Notices(), should_stop=lambda: False)
    rollouts.members, rollouts.stale = [beside, apart], False
    rollouts.channels.formed = {"w-0": ("beside:1",), "w-1": ("apart:1",)}
    rollouts.channels.colocated = {"beside:1"}
    await rollouts.sleep()
    await rollouts.wake_up()
    await asyncio.wait_for(rollouts.sync(3), 5)
    assert sorted(trainer.sent_on) == ["w-0", "w-1"] and rollouts.served == 3
    assert beside.calls == ["sleep", "wake_up"] and apart.calls == []


class ReadyTrainer:
    """A trainer that joins any channel at once and sends its weights, of ``version``, into it."""

    def __init__(self, version: int):
        self.version = version

    async def placement(self, timeout=None):
        return TrainerPlacement(gpu="", ranks=1)

    async def prepare_channel(self, channel_id, backend, world_size, timeout, keep_joined=False):
        return b"127.0.0.1:1"

    async def join_channel(self, channel_id, backend, rendezvous, world_size, timeout):
        pass

    async def broadcast_weights(self, channel_id, bucket_bytes, timeout):
        return SyncResult(weight_version=self.version, total_bytes=1024, buckets=1, seconds=0.001)


class RestartedRollout:
    """A rollout that systemd started again after a kill -9: no model loaded until its InitRun, which lasts until
    ``may_load`` is set; then it joins any channel and takes what ``trainer`` sends."""

    def __init__(self, address: str, trainer: ReadyTrainer):
        self.address, self.trainer, self.run_id, self.version = address, trainer, "", -1
        self.init_runs, self.may_load = 0, asyncio.Event()

    async def info(self, timeout=None):
        return RolloutInfo(run_id=self.run_id, weight_version=self.version, channel_ranks=1)

    async def init_run(self, run_id, model_path, **settings):
        self.init_runs += 1
        await self.may_load.wait()
        self.run_id, self.version = run_id, 0
        return 1

    async def join_channel(self, channel_id, backend, rendezvous, rank, world_size, timeout):
        pass

    async def receive_weights(self, channel_id, timeout, partial_rollout="finish"):
        self.version = self.trainer.version
        return Received(version=self.version, transfer_s=0.01, pause_s=0.0)

    async def close(self):
        pass


async def test_a_generation_ahead_and_the_loops_sync_take_a_restarted_rollout_in_once():
    """The run's only rollout was killed and came back: the generation ahead (which refreshes) and the loop's sync
    both find it. It is asked to load the run's model once, not twice at once (two loads at once in one rollout
    broke its model: "Cannot copy out of meta tensor"), and then serves the version sent."""
    trainer = ReadyTrainer(version=3)
    rollout = RestartedRollout("r:1", trainer)
    rollouts = RolloutSet("run", rollout_set_settings(validate(RunConfig, {})), actor=trainer,
                          find=lambda: ["r:1"], notices=Notices(), should_stop=lambda: False,
                          connect=lambda address: rollout)
    rollouts.version = 3
    both = asyncio.gather(rollouts.refresh(), rollouts.sync(3))
    for _ in range(200):  # every call either makes is answered at once: ample turns for both to reach InitRun
        await asyncio.sleep(0)
    assert rollout.init_runs == 1 and not both.done()
    rollout.may_load.set()
    await asyncio.wait_for(both, 5)
    assert rollout.init_runs == 1 and rollouts.members == [rollout] and rollouts.served == 3 == rollout.version


async def test_a_refresh_sends_the_actors_weights_of_the_moment_past_the_version_last_synced():
    """The run's only rollout came back while the loop's update made version 4 (its sync of 4 not yet begun): the
    generation ahead's refresh takes the rollout in with version 4, which it then serves, not a failed run ("the
    trainer sent weight version 4, not 3")."""
    trainer = ReadyTrainer(version=4)
    rollout = RestartedRollout("r:1", trainer)
    rollout.may_load.set()
    rollouts = RolloutSet("run", rollout_set_settings(validate(RunConfig, {})), actor=trainer,
                          find=lambda: ["r:1"], notices=Notices(), should_stop=lambda: False,
                          connect=lambda address: rollout)
    rollouts.version = rollouts.served = 3
    await asyncio.wait_for(rollouts.refresh(), 5)
    assert rollouts.members == [rollout] and rollouts.served == rollouts.version == 4 == rollout.version
    await asyncio.wait_for(rollouts.sync(4), 5)  # the loop's sync of 4 that follows
    assert rollouts.served == 4 == rollout.version
