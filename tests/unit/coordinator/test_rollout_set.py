"""CPU tests of services/coordinator/rollout_set.py: a formation that a rollout refuses every time, and which
members sleep while the trainer works (the fakes are those of test_weight_channels.py)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.common.config import validate
from services.common.errors import Unavailable
from services.run.config import RunConfig
from services.coordinator.clients import RolloutInfo, SyncResult, TrainerPlacement
from services.coordinator.rollout_set import RolloutSet
from services.coordinator.settings import rollout_set_settings
from services.coordinator.weight_channels import ChannelNotFormed
from tests.unit.coordinator.test_weight_channels import Notices, SyncingMember, refused


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
