"""CPU tests of services/coordinator/fleet/weight_channels.py: the weight channels' transport, a send that a member
fails, and what a channel that keeps failing to form does to the run."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.common.config import validate
from services.common.errors import FROM_HANDLER, ORIGIN_KEY, Unavailable
from services.run.config import RunConfig
from services.coordinator.fleet.clients import Received, RolloutInfo, TrainerPlacement
from services.coordinator.fleet.rollout_set import RolloutSet
from services.coordinator.runs.supervisor import recoverable
from services.coordinator.settings import rollout_set_settings
from services.coordinator.fleet.weight_channels import ChannelNotFormed, ChannelPlan, devices_held, not_formed, plan_channels


def on(*gpus: str, colocated: bool | None = None) -> RolloutInfo:
    return RolloutInfo(run_id="run", weight_version=0, channel_ranks=1, gpus=frozenset(gpus), colocated=colocated)


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
            return Received(version=3, transfer_s=0.01, pause_s=0.0)
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
    rollouts = RolloutSet("run", rollout_set_settings(validate(RunConfig, {})), actor=trainer, find=lambda: [],
                          notices=Notices(), should_stop=lambda: False)
    rollouts.members = list(members)
    rollouts.channels.formed = {"run-weights-1": tuple(member.address for member in members)}
    return rollouts, trainer


async def test_a_member_failing_mid_sync_ends_the_wait_for_the_trainers_side():
    """The trainer's side would wait for the member until the channel's deadline (120 s): the sync fails at once,
    the trainer's call is cancelled (its broadcast is abandoned when the next channel is prepared)."""
    rollouts, trainer = syncing(SyncingMember("ok:1"), SyncingMember("bad:1", Unavailable("engine gone")))
    failure, _ = await asyncio.wait_for(rollouts.channels.broadcast(3), 5)
    assert trainer.cancelled.is_set()
    assert failure == ("weight sync of version 3 on channel run-weights-1 failed (a rollout's side: Unavailable: "
                       "engine gone); not serving it: bad:1")


async def test_a_member_leaving_mid_sync_is_named_as_the_cause():
    stopped = SyncingMember("stopped:1", Unavailable("no answer"))
    rollouts, trainer = syncing(SyncingMember("ok:1"), stopped)
    sync = asyncio.ensure_future(rollouts.channels.broadcast(3))
    await asyncio.sleep(0.01)
    await rollouts.drop("stopped:1", "no heartbeat for 5 s")  # closes its client: its receive ends
    failure, _ = await asyncio.wait_for(sync, 5)
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


async def test_a_sync_failing_on_one_channel_abandons_the_others():
    """The trainer's model thread may be held by the failed broadcast until the next channel is prepared: the
    other channel's send is not waited for."""
    rollouts, trainer = syncing(SyncingMember("ok:1"), SyncingMember("bad:1", Unavailable("engine gone")))
    rollouts.channels.formed = {"w-0": ("ok:1",), "w-1": ("bad:1",)}
    failure, _ = await asyncio.wait_for(rollouts.channels.broadcast(3), 5)
    assert trainer.cancelled.is_set()
    assert failure == ("weight sync of version 3 on channel w-1 failed (a rollout's side: Unavailable: engine "
                       "gone); not serving it: bad:1")


def test_the_devices_a_run_holds_count_each_gpu_once_and_each_process_on_a_cpu():
    one_rank, two_ranks = TrainerPlacement(gpu="GPU-a", ranks=1), TrainerPlacement(gpu="GPU-a", ranks=2)
    # colocated on one GPU; trainer on GPU 0 and a rollout on GPU 1; a rollout on each GPU, one beside the trainer
    assert devices_held(one_rank, [on("GPU-a")]) == 1
    assert devices_held(one_rank, [on("GPU-b")]) == 2
    assert devices_held(one_rank, [on("GPU-a"), on("GPU-b")]) == 2
    # two rollouts of tensor parallel 2 on GPUs b..e, and one more on c (counted once), beside 2 trainer ranks
    assert devices_held(two_ranks, [on("GPU-b", "GPU-c"), on("GPU-d", "GPU-e"), on("GPU-c")]) == 6
    # a rollout that says it shares the trainer's devices adds none (every GPU generating on a sharded trainer)
    assert devices_held(two_ranks, [on("GPU-z", colocated=True)]) == 2
    # on a CPU: the trainer's ranks and each rollout, one process each
    assert devices_held(TrainerPlacement(gpu="", ranks=1), [on(), on()]) == 3
    assert devices_held(TrainerPlacement(gpu="", ranks=2), [on()]) == 3
