"""The rollout service's engines behind one async interface, and the choice between them.

An engine is created by InitRun and then called from the servicer:
``generate`` for each Generate call (many may be in flight), ``join_channel``
when the coordinator sets up the weight channel, ``receive_weights`` for
each sync (generation is held back while weights are swapped), ``sleep`` and
``wake_up`` when a trainer shares the GPU, ``close`` at the end.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

from services.common.channel import ChannelTable
from services.common.models import load_causal_lm, load_tokenizer
from services.common.weight_sync import receive_weights
from services.rollout.config import RolloutServiceConfig
from services.rollout.hf_engine import Completion, HFEngine, SamplingSettings


@dataclass(frozen=True)
class WeightSwap:
    """One weight sync as a rollout engine saw it."""

    version: int
    transfer_s: float  # receiving the weights (generation may go on meanwhile)
    pause_s: float  # generation held back: the calls in flight finishing, the swap itself
    stages: dict[str, float] = dataclasses.field(default_factory=dict)  # seconds per stage, where the engine knows


class Engine(Protocol):
    vocab_size: int
    channel_ranks: int  # ranks this engine takes in a weight channel (one per worker)
    weight_version: int  # of the weights it serves now (0 until the first sync)

    async def generate(self, prompts: list[list[int]], sampling: SamplingSettings,
                       first_index: int) -> list[list[Completion]]:
        """``sampling.n`` completions per prompt, prompt i seeded from ``first_index + i``, each stamped with
        the weight version that sampled it."""

    async def join_channel(self, channel_id: str, backend: str, rendezvous: bytes, rank: int, world_size: int,
                           timeout_s: float) -> None:
        """Join a weight channel; this engine's workers take ranks rank .. rank + channel_ranks - 1."""

    async def receive_weights(self, channel_id: str, timeout_s: float) -> WeightSwap:
        """Receive one broadcast and swap it in."""

    async def sleep(self) -> None:
        """Free the GPU memory the engine holds (weights and KV cache) for a trainer on the same GPU."""

    async def wake_up(self) -> None:
        """Take the memory back after sleep."""

    async def close(self) -> None:
        """Release everything."""


class HFRolloutEngine:
    """The transformers engine: all model work on one thread, so a swap never interleaves a generation."""

    channel_ranks = 1

    def __init__(self, model_path: str, dtype: str, config: RolloutServiceConfig):
        tokenizer = load_tokenizer(model_path)
        model = load_causal_lm(model_path, dtype).to(config.device)
        eos = tokenizer.eos_token_id
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
        self.engine = HFEngine(model, pad, (eos,), config.batch_size)
        self.vocab_size = model.config.vocab_size
        self.weight_version = 0  # written on the engine thread, between generations
        self.channels = ChannelTable(config.device)
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")

    async def _on_engine(self, function, *args):
        return await asyncio.get_running_loop().run_in_executor(self._thread, function, *args)

    async def generate(self, prompts, sampling, first_index):
        def generate():
            version = self.weight_version
            return [[dataclasses.replace(c, weight_version=version) for c in group]
                    for group in self.engine.generate(prompts, sampling, first_index)]

        return await self._on_engine(generate)

    async def join_channel(self, channel_id, backend, rendezvous, rank, world_size, timeout_s):
        """Leave the channels joined before (on the engine thread: after a receive still on one, since closing
        a group with a collective in flight blocks), then join this one."""
        await self._on_engine(self.channels.close_all)
        await self.channels.join(channel_id, backend, rendezvous, rank, world_size, timeout_s)

    async def receive_weights(self, channel_id, timeout_s):
        """On the engine thread, between generations: they wait for the whole transfer."""
        channel = self.channels.get(channel_id)

        def receive() -> WeightSwap:
            started = time.perf_counter()
            self.weight_version = receive_weights(channel, self.engine.load_weights)
            seconds = time.perf_counter() - started
            return WeightSwap(self.weight_version, seconds, seconds)

        return await self._on_engine(receive)

    async def sleep(self):
        pass

    async def wake_up(self):
        pass

    async def close(self):
        self.channels.close_all()
        self._thread.shutdown(wait=False, cancel_futures=True)


async def load_engine(config: RolloutServiceConfig, model_path: str, dtype: str) -> Engine:
    """The engine the service is configured for, with the run's model loaded."""
    if config.engine == "vllm":
        from services.rollout.vllm_engine import VLLMEngine

        return await VLLMEngine.create(model_path, dtype, config)
    return await asyncio.to_thread(HFRolloutEngine, model_path, dtype, config)
