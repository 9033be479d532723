"""Adapter-only syncs into the hf rollout engine: a LoRA trainer's factors sent over a real gloo channel with the
bucket checksums, served as base + scale * B @ A; a damaged or unfitting adapter leaves the previous one serving."""

from __future__ import annotations

import asyncio

import pytest
import torch
import yaml

from services.common.gloo_channel import GlooChannel, prepare_gloo_rendezvous
from services.common.weight_sync import WeightSender
from services.coordctl.tiny_model import build_tiny_model
from services.rollout.config import RolloutServiceConfig
from services.rollout.engines import HFRolloutEngine
from services.trainer.ranks import Ranks
from services.trainer.worker import RankWorker

IDS = torch.tensor([[5, 6, 7, 8, 9, 10]])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", hidden_size=32, num_layers=2, num_heads=2, seed=0)


def lora_actor(tiny):
    worker = RankWorker(Ranks.single("cpu"))
    config = yaml.safe_dump({"actor_rollout_ref": {"model": {"path": str(tiny), "lora_rank": 4, "lora_alpha": 8,
                                                             "target_modules": ["q_proj", "v_proj", "down_proj"]}}})
    return worker.init_run({}, run_id="r", run_config_yaml=config, roles=["actor"], seed=0).actor


def move_adapters(actor, seed: int) -> None:
    """Random adapters, as training would leave them (B is zero at the start)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in actor.model.named_parameters():
            if ".lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)


def trainer_logits(actor) -> torch.Tensor:
    with torch.no_grad():
        return actor.model(input_ids=IDS).logits


def served_logits(engine: HFRolloutEngine) -> torch.Tensor:
    with torch.no_grad():
        return engine.engine.model(input_ids=IDS).logits


async def sync(engine: HFRolloutEngine, channel_id: str, send) -> object:
    """Receive on the engine while ``send`` runs on a thread; the engine's result or error."""
    sending = asyncio.create_task(asyncio.to_thread(send))
    try:
        return await engine.receive_weights(channel_id, 10.0)
    finally:
        await sending


async def joined(engine: HFRolloutEngine, name: str) -> GlooChannel:
    store, rendezvous = prepare_gloo_rendezvous("127.0.0.1", 10)
    trainer_side = asyncio.create_task(asyncio.to_thread(GlooChannel, name, rendezvous, 0, world_size=2, timeout_s=10))
    await engine.join_channel(name, "gloo", rendezvous, rank=1, world_size=2, timeout_s=10.0)
    channel = await trainer_side
    del store
    return channel


def test_adapters_synced_over_gloo_are_served_as_base_plus_scaled_b_a_each_version_replacing_the_last(tiny):
    actor = lora_actor(tiny)
    engine = HFRolloutEngine(str(tiny), "float32", RolloutServiceConfig())
    base = {name: p.clone() for name, p in engine.engine.model.named_parameters()}
    sender = WeightSender()

    async def main():
        channel = await joined(engine, "adapters")
        results = []
        for version, seed in ((1, 0), (2, 1)):
            move_adapters(actor, seed)
            results.append(await sync(engine, "adapters", lambda v=version: sender.send(
                channel, actor.named_weights(), version=v, bucket_bytes=4096)))
            assert torch.allclose(served_logits(engine), trainer_logits(actor), atol=1e-5)
            assert engine.weight_version == version
        channel.close()
        await engine.close()
        return results

    swaps = asyncio.run(main())
    assert [swap.version for swap in swaps] == [1, 2]
    served = dict(engine.engine.model.named_parameters())
    adapted = {f"model.layers.{i}.{m}.weight" for i in range(2) for m in ("self_attn.q_proj", "self_attn.v_proj",
                                                                          "mlp.down_proj")}
    assert all(torch.equal(served[name], base[name]) for name in base if name not in adapted)  # untouched
    assert all(not torch.equal(served[name], base[name]) for name in adapted)


class WrongChecksum:
    """The trainer's real channel, sending a wrong checksum for the first bucket (as a bad link or buffer would
    make the receiver compute)."""

    def __init__(self, channel):
        self.channel, self.device, self.corrupted = channel, channel.device, False

    def broadcast(self, tensor, root=0):
        self.channel.broadcast(tensor, root)

    def start_broadcast(self, tensor, root=0):
        if not self.corrupted and tensor.dtype == torch.int64 and tensor.numel() == 1:  # a bucket's checksum
            tensor = tensor + 1
            self.corrupted = True
        return self.channel.start_broadcast(tensor, root)


def test_a_damaged_or_unfitting_adapter_leaves_the_previous_one_serving(tiny):
    actor = lora_actor(tiny)
    engine = HFRolloutEngine(str(tiny), "float32", RolloutServiceConfig())
    sender = WeightSender()

    async def main():
        channel = await joined(engine, "damaged")
        move_adapters(actor, 0)
        await sync(engine, "damaged", lambda: sender.send(channel, actor.named_weights(), version=1, bucket_bytes=4096))
        serving = served_logits(engine)
        move_adapters(actor, 1)
        with pytest.raises(ValueError, match=r"weight buckets \[0\] of version 2 failed their checksums"):
            await sync(engine, "damaged", lambda: sender.send(WrongChecksum(channel), actor.named_weights(), version=2,
                                                              bucket_bytes=4096))
        assert engine.weight_version == 1 and torch.equal(served_logits(engine), serving)
        assert engine.damaged is None  # nothing of it went in: the previous adapter serves, whole
        wrong = [(name, tensor[:, :-1] if name.endswith("lora_A") else tensor)
                 for name, tensor in actor.named_weights()]
        with pytest.raises(ValueError, match=r"which does not fit its 32 x 32 weight"):
            await sync(engine, "damaged", lambda: sender.send(channel, wrong, version=3, bucket_bytes=4096))
        assert engine.weight_version == 1 and torch.equal(served_logits(engine), serving)
        assert engine.damaged is None
        channel.close()
        await engine.close()

    asyncio.run(main())
