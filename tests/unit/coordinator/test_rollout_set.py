"""CPU tests of services/coordinator/rollout_set.py: the weight channel's transport, a sync that a member
fails, and what a channel that keeps failing to form does to the run."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.common.config import validate
from services.common.errors import FROM_HANDLER, ORIGIN_KEY, Unavailable
from services.run.config import RunConfig
from services.coordinator.clients import Received, RolloutInfo, SyncResult
from services.coordinator.rollout_set import ChannelNotFormed, ChannelPlan, RolloutSet, not_formed, plan_channels
from services.coordinator.runs import recoverable
from services.coordinator.settings import rollout_set_settings


def on(*gpus: str, colocated: bool | None = None) -> RolloutInfo:
    return RolloutInfo("run", 0, 1, frozenset(gpus), colocated)


def test_weight_channels_follow_where_trainer_and_rollouts_sit():
    """One channel per transport and sharing of the trainer's device, each with the rollouts of its kind."""
    assert plan_channels("auto", "", {"r1:1": on(), "r2:1": on()}) == [ChannelPlan("gloo", True, ("r1:1", "r2:1"))]
    assert plan_channels("auto", "GPU-a", {"r1:1": on("GPU-b"), "r2:1": on("GPU-c", "GPU-d")}) == [
        ChannelPlan("nccl", False, ("r1:1", "r2:1"))]
    # colocated: NCCL refuses two ranks on one GPU, so the weights go over CUDA IPC
    assert plan_channels("auto", "GPU-a", {"r1:1": on("GPU-a"), "r2:1": on("GPU-a", "GPU-b")}) == [
        ChannelPlan("cuda_ipc", True, ("r1:1", "r2:1"))]
    # every GPU generating: CUDA IPC to the one on the trainer's GPU, NCCL to the others
    assert plan_channels("auto", "GPU-a", {"r3:1": on("GPU-c"), "r1:1": on("GPU-b"), "r2:1": on("GPU-a")}) == [
        ChannelPlan("nccl", False, ("r1:1", "r3:1")), ChannelPlan("cuda_ipc", True, ("r2:1",))]
    # a rollout that says it does not share the trainer's device (CPU) gets a channel of its own, as on GPUs
    assert plan_channels("auto", "", {"r1:1": on(), "r2:1": on(colocated=False)}) == [
        ChannelPlan("gloo", True, ("r1:1",)), ChannelPlan("gloo", False, ("r2:1",))]
    # a configured transport holds for all; what a rollout says of itself wins over its GPUs
    assert plan_channels("cuda_ipc", "GPU-a", {"r1:1": on("GPU-a"), "r2:1": on("GPU-b", colocated=True)}) == [
        ChannelPlan("cuda_ipc", True, ("r1:1", "r2:1"))]


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

    async def receive_weights(self, channel_id, timeout, partial_rollout="finish"):
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
    rollouts.members = list(members)
    rollouts.channels = {"run-weights-1": tuple(member.address for member in members)}
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


# ---------------------------------------------------------------------------
# a weight channel that keeps failing to form


def refused(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """A status the called service's interceptor set (its own verdict, not the transport's)."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata((ORIGIN_KEY, FROM_HANDLER)), details)


def test_a_channel_refused_in_every_formation_fails_the_run_naming_the_first_refusal():
    cuda = refused(grpc.StatusCode.INVALID_ARGUMENT, "ValueError: channel backend cuda_ipc needs a CUDA device")
    ending = not_formed([("rollout r:1 did not join", cuda)] * 3)
    assert isinstance(ending, ChannelNotFormed) and not recoverable(ending)
    assert str(ending) == ("the weight channel could not be formed in 3 attempts; the first: rollout r:1 did not "
                           "join (INVALID_ARGUMENT: ValueError: channel backend cuda_ipc needs a CUDA device)")
    out_of_memory = refused(grpc.StatusCode.RESOURCE_EXHAUSTED, "OutOfMemoryError: CUDA out of memory")
    assert isinstance(not_formed([("rollout r:1 did not join", out_of_memory)] * 3), ChannelNotFormed)


@pytest.mark.parametrize("cause", [
    refused(grpc.StatusCode.UNAVAILABLE, "engine restarting"),
    refused(grpc.StatusCode.DEADLINE_EXCEEDED, "TimeoutError: not all 2 members joined within 120 s"),
    grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, grpc.aio.Metadata(), grpc.aio.Metadata(), "connection reset"),
    Unavailable("it left the run meanwhile"),
])
def test_a_formation_that_failed_for_a_passing_cause_lets_the_run_recover_naming_the_first(cause):
    """One transient cause among lasting ones is enough: the run waits for its services (a recovery, of
    trainer.max_recoveries), then forms the channel again."""
    lasting = refused(grpc.StatusCode.INTERNAL, "RuntimeError: engine broken")
    ending = not_formed([("rollout a:1 did not join", lasting), ("rollout b:1 did not join", cause)])
    assert isinstance(ending, Unavailable) and recoverable(ending)
    assert str(ending).startswith("the weight channel could not be formed in 2 attempts; the first: rollout a:1 "
                                  "did not join (INTERNAL: RuntimeError: engine broken)")


class JoiningTrainer:
    """The actor's side of a formation: it waits for the members until the channel's deadline."""

    async def gpu(self, timeout=None):
        return ""

    async def prepare_channel(self, channel_id, backend, world_size, timeout, keep_joined=False):
        return b"127.0.0.1:1"

    async def join_channel(self, channel_id, backend, rendezvous, world_size, timeout):
        await asyncio.sleep(timeout)


class RefusingRollout:
    """A rollout that has the run loaded and answers, but refuses every JoinChannel with ``refusal``."""

    def __init__(self, address: str, refusal: BaseException):
        self.address, self.refusal, self.joins = address, refusal, 0

    async def info(self, timeout=None):
        return RolloutInfo("run", 0, 1)

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
    rollouts = RolloutSet("run", rollout_set_settings(validate(RunConfig, {})), JoiningTrainer(), lambda: ["r:1"],
                          notices, lambda: False, connect=lambda address: rollout)
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
        return SyncResult(3, 1024, 1, 0.001)


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
    rollouts = RolloutSet("run", rollout_set_settings(validate(RunConfig, {})), trainer, lambda: [], Notices(),
                          lambda: False)
    rollouts.members, rollouts.stale = [beside, apart], False
    rollouts.channels, rollouts.colocated = {"w-0": ("beside:1",), "w-1": ("apart:1",)}, {"beside:1"}
    await rollouts.sleep()
    await rollouts.wake_up()
    await asyncio.wait_for(rollouts.sync(3), 5)
    assert sorted(trainer.sent_on) == ["w-0", "w-1"] and rollouts.served == 3
    assert beside.calls == ["sleep", "wake_up"] and apart.calls == []


async def test_a_sync_failing_on_one_channel_abandons_the_others():
    """The trainer's model thread may be held by the failed broadcast until the next channel is prepared: the
    other channel's send is not waited for."""
    rollouts, trainer = syncing(SyncingMember("ok:1"), SyncingMember("bad:1", Unavailable("engine gone")))
    rollouts.channels = {"w-0": ("ok:1",), "w-1": ("bad:1",)}
    failure = await asyncio.wait_for(rollouts._broadcast(3), 5)
    assert trainer.cancelled.is_set()
    assert failure == ("weight sync of version 3 on channel w-1 failed (a rollout's side: Unavailable: engine "
                       "gone); not serving it: bad:1")
