"""Adapter-only weight sync against full-weight sync, on the CPU: trainer -> hf rollout engine over gloo.

For one model (the local default's tiny Qwen2 by default; ``--size 0.5b`` for Qwen2.5-0.5B's shape, random
weights), two trainers are loaded in this process as the trainer service loads them: a full fine-tune and a
LoRA actor (``--rank``, alpha 2 x rank, all-linear). Each syncs ``--syncs`` times into its own hf rollout
engine over a real gloo channel (WeightSender, the bucket checksums, the engine's staging and swap; the
weights or adapters change before every sync). Reported per kind: bytes per sync and the median seconds from
the send's start to the engine serving the new version. The figure last: full / LoRA, bytes and seconds.

    python bench/lora_sync.py [--size local|0.5b] [--rank 32] [--syncs 10]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import torch
import yaml

from services.common.gloo_channel import GlooChannel, prepare_gloo_rendezvous
from services.common.weight_sync import WeightSender
from services.coordctl.tiny_model import QWEN25_SHAPES, build_random_model, build_tiny_model
from services.rollout.config import RolloutServiceConfig
from services.rollout.engines import HFRolloutEngine
from services.trainer.ranks import Ranks
from services.trainer.worker import RankWorker

BUCKET_BYTES = 64 << 20  # the coordinator's default bucket size


def build_model(size: str, folder: Path) -> Path:
    if size == "local":  # coordctl start-run --local's tiny model
        return build_tiny_model(folder, hidden_size=128, num_layers=2, num_heads=4, seed=0)
    return build_random_model(folder, {**QWEN25_SHAPES[size], "max_position_embeddings": 512}, "float32", seed=0)


def load_actor(model: Path, rank: int):
    lora = {"lora_rank": rank, "lora_alpha": 2 * rank} if rank else {}
    config = yaml.safe_dump({"actor_rollout_ref": {"model": {"path": str(model), **lora}}})
    return RankWorker(Ranks.single("cpu")).init_run({}, run_id="bench", run_config_yaml=config, roles=["actor"],
                                               seed=0).actor


@torch.no_grad()
def change(actor) -> None:
    """Move what the actor trains (every weight, or the adapters) a little, as an update would."""
    for parameter in actor.model.parameters():
        if parameter.requires_grad:
            parameter.add_(torch.randn_like(parameter) * 1e-3)


async def measure(actor, model: Path, syncs: int, name: str) -> tuple[int, list[float]]:
    """Bytes per sync and the seconds of each sync, from the send's start to the engine serving the version."""
    engine = HFRolloutEngine(str(model), "float32", RolloutServiceConfig())
    store, rendezvous = prepare_gloo_rendezvous("127.0.0.1", 60)
    trainer_side = asyncio.create_task(asyncio.to_thread(GlooChannel, name, rendezvous, 0, world_size=2, timeout_s=60))
    await engine.join_channel(name, "gloo", rendezvous, rank=1, world_size=2, timeout_s=60.0)
    channel = await trainer_side
    sender, seconds, total = WeightSender(), [], 0
    for version in range(1, syncs + 2):
        change(actor)
        named = actor.named_weights()
        started = time.perf_counter()
        sending = asyncio.create_task(asyncio.to_thread(sender.send, channel, named, version,
                                                        bucket_bytes=BUCKET_BYTES))
        swap = await engine.receive_weights(name, 60.0)
        total, _ = await sending
        if version > 1:  # the first carries the manifest and makes the buffers
            seconds.append(time.perf_counter() - started)
        assert swap.version == version
    channel.close()
    await engine.close()
    del store
    return total, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=["local", *QWEN25_SHAPES], default="local")
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--syncs", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(args.size, Path(tmp) / "model")
        results = {}
        for kind, rank in (("full", 0), ("lora", args.rank)):
            actor = load_actor(model, rank)
            total, seconds = asyncio.run(measure(actor, model, args.syncs, kind))
            results[kind] = total, statistics.median(seconds)
            print(f"{kind:>4}: {len(actor.named_weights())} tensors, {total / 2**20:.3f} MiB per sync, "
                  f"median {results[kind][1] * 1e3:.1f} ms over {len(seconds)} syncs")
            del actor
    (full_bytes, full_s), (lora_bytes, lora_s) = results["full"], results["lora"]
    print(f"model {args.size}, LoRA rank {args.rank}: full / LoRA = {full_bytes / lora_bytes:.1f}x the bytes, "
          f"{full_s / lora_s:.1f}x the sync seconds")


if __name__ == "__main__":
    main()
