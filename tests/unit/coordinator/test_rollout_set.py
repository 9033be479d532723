"""CPU tests of services/coordinator/rollout_set.py: the weight channel's transport, a sync that a member
fails, and what a channel that keeps failing to form does to the run."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.common.config import validate
from services.common.errors import FROM_HANDLER, ORIGIN_KEY, Unavailable
from services.common.run_config import RunConfig
from services.coordinator.clients import Received, RolloutInfo
from services.coordinator.rollout_set import ChannelNotFormed, RolloutSet, channel_backend, not_formed
from services.coordinator.runs import recoverable
from services.coordinator.settings import rollout_set_settings


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

    async def prepare_channel(self, channel_id, backend, world_size, timeout):
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
