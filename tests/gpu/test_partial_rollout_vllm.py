"""The vLLM rollout around weight syncs: Generate calls in flight at a sync, and a sync that breaks off.

First the scenario of tests/integration/test_partial_rollout.py, with a vLLM rollout on GPU 1 and this process,
the trainer, sending from GPU 0 over NCCL: with restart_in_flight the call's requests are aborted in vLLM and
sampled again, whole, under the new weights (equal to a fresh call under them); without it the call finishes
under the old ones while the swap waits. Then a sync that breaks off after its first bucket (nothing
generating, so the rollout was loading the buckets straight into its model): the rollout refuses Generate as
unavailable until a whole sync has arrived.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from bench.faults import service_address
from services.common.channel import open_weight_channel
from services.run.models import load_causal_lm
from services.common.nccl_channel import new_unique_id
from services.common.weight_sync import WeightSender
from services.coordinator.fleet.clients import RolloutClient
from services.coordinator.settings import Sampling
from services.coordctl.local import LocalCluster
from tests.gpu.conftest import needs, vllm_rollout
from tests.integration.test_partial_rollout import PROMPTS, scenario

# vLLM samples the 8 sequences together: long responses keep the call in flight while the weights go out
TOKENS = 600


class BreaksOff:
    """The trainer's channel, gone after ``broadcasts`` broadcasts (as when the trainer dies mid-sync)."""

    def __init__(self, channel, broadcasts: int):
        self.channel, self.device, self.left = channel, channel.device, broadcasts

    def broadcast(self, tensor, root=0):
        self.start_broadcast(tensor, root).wait()

    def start_broadcast(self, tensor, root=0):
        if self.left == 0:
            raise ConnectionError("the trainer went away")
        self.left -= 1
        return self.channel.start_broadcast(tensor, root)


async def a_sync_breaks_off(cluster: LocalCluster, model_path: str) -> None:
    rollout = RolloutClient(service_address(cluster, "rollout"))
    named = [(name, tensor.detach().to("cuda:0"))
             for name, tensor in load_causal_lm(model_path, "bfloat16").named_parameters()]

    async def generate():
        return await rollout.generate(PROMPTS, Sampling(n=2, temperature=1.0, top_p=1.0, max_new_tokens=8,
                                                        stop_token_ids=()), seed=1, first_index=0, timeout=60)

    async def sync(channel_id: str, version: int, broadcasts: int | None) -> tuple:
        """(what the trainer's WeightSender.send returned or raised, what the rollout's ReceiveWeights did)."""
        unique_id = new_unique_id()
        joining = asyncio.create_task(rollout.join_channel(channel_id, "nccl", unique_id, rank=1, world_size=2, timeout=60))
        channel = await asyncio.to_thread(open_weight_channel, channel_id, "nccl", rendezvous=unique_id, rank=0,
                                          world_size=2, timeout_s=60, device="cuda:0")
        await joining
        sender = channel if broadcasts is None else BreaksOff(channel, broadcasts)
        receiving = asyncio.create_task(rollout.receive_weights(channel_id, 5))
        try:
            sent = await asyncio.to_thread(WeightSender().send, sender, named, version, bucket_bytes=64 << 20)
        except ConnectionError as error:
            sent = error
        try:
            received = await receiving
        except grpc.aio.AioRpcError as error:
            received = error
        channel.close()
        return sent, received

    try:
        # header, manifest, the first bucket and its checksum, then nothing: the rollout waits out its deadline
        sent, broken = await sync("broken-sync", 10, broadcasts=4)
        assert isinstance(sent, ConnectionError) and isinstance(broken, grpc.aio.AioRpcError), (sent, broken)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await generate()
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and "not one whole version" in refused.value.details()
        sent, received = await sync("whole-sync", 11, broadcasts=None)
        assert received.version == 11
        assert set((await generate()).weight_versions.tolist()) == {11}
        print(f"\nbroken-off sync: ReceiveWeights {broken.code()}: {broken.details()}; then Generate "
              f"{refused.value.code()}: {refused.value.details()}")
    finally:
        await rollout.close()


@needs(2)
def test_vllm_rollout_restarts_or_finishes_calls_in_flight_and_refuses_to_generate_after_a_broken_sync(qwen_05b,
                                                                                                       tmp_path):
    cluster = LocalCluster(tmp_path / "state", (
        vllm_rollout(1, 0.3),))
    try:
        asyncio.run(cluster.start(timeout_s=180))
        asyncio.run(scenario(cluster, str(qwen_05b), dtype="bfloat16", backend="nccl", device="cuda:0",
                             tokens=TOKENS, phases=("restart and finish",)))  # keep: test_keep_swap_vllm.py
        asyncio.run(a_sync_breaks_off(cluster, str(qwen_05b)))
    finally:
        cluster.stop()
