"""The vLLM engine of the rollout service (GPU): AsyncLLM, token ids in and out.

- Prompts go in as token ids and responses come out as token ids: no
  tokenizer runs in the engine (``skip_tokenizer_init``), so nothing is
  re-tokenised; EOS and the run's stop tokens end a response.
- The logprob of each sampled token is the processed one (after
  temperature), the quantity the trainer recomputes.
- Each of the n samples of prompt i is seeded from (seed, first_index + i),
  as in the hf engine, so a prompt's samples do not depend on the replica.
- Weights arrive inside vLLM's workers, through the worker extension
  ``services.rollout.vllm_worker.MeshrlWorkerExtension``: the coordinator's
  channel id, unique id and ranks reach it by ``collective_rpc``, and every
  tensor-parallel worker receives the full HF-named tensors, which vLLM's
  ``load_weights`` reslices (with one worker, later syncs copy straight
  into the places the first one showed: ``direct_load``). Generation is
  paused and the prefix cache cleared around the swap.
- Worker processes are spawned, not forked: this process already runs gRPC.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.common.models import load_tokenizer
from services.rollout.config import RolloutServiceConfig
from services.rollout.direct_load import STACKED
from services.rollout.hf_engine import Completion, SamplingSettings, hash_seed

if TYPE_CHECKING:
    import torch

WORKER_EXTENSION = "services.rollout.vllm_worker.MeshrlWorkerExtension"


@dataclass(frozen=True)
class SyncTimings:
    """Seconds of the last weight sync: draining and pausing, receiving and loading, and the whole pause."""

    pause_s: float
    receive_s: float
    paused_s: float


class VLLMEngine:
    def __init__(self, llm, vocab_size: int, eos_id: int | None, channel_ranks: int):
        self.llm = llm
        self.last_sync: SyncTimings | None = None
        self.vocab_size = vocab_size
        self.eos_id = eos_id
        self.channel_ranks = channel_ranks

    @classmethod
    async def create(cls, model_path: str, dtype: str, config: RolloutServiceConfig) -> VLLMEngine:
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args = AsyncEngineArgs(
            model=model_path, dtype=dtype, skip_tokenizer_init=True, seed=0,
            gpu_memory_utilization=config.gpu_memory_utilization,
            tensor_parallel_size=config.tensor_parallel_size, enforce_eager=config.enforce_eager,
            enable_sleep_mode=config.enable_sleep_mode, max_model_len=config.max_model_len,
            logprobs_mode="processed_logprobs", worker_extension_cls=WORKER_EXTENSION,
        )
        llm = await asyncio.to_thread(AsyncLLM.from_engine_args, args)
        tokenizer = await asyncio.to_thread(load_tokenizer, model_path)
        vocab_size = llm.vllm_config.model_config.get_vocab_size()
        return cls(llm, vocab_size, tokenizer.eos_token_id, config.tensor_parallel_size)

    async def generate(self, prompts: list[list[int]], sampling: SamplingSettings,
                       first_index: int) -> list[list[Completion]]:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        stops = sorted(set(sampling.stop_token_ids) | ({self.eos_id} if self.eos_id is not None else set()))

        async def one(index: int, prompt: list[int]) -> list[Completion]:
            params = SamplingParams(
                n=sampling.n, temperature=sampling.temperature, top_p=sampling.top_p,
                max_tokens=sampling.max_new_tokens, seed=hash_seed(sampling.seed, first_index + index, 0) % (1 << 31),
                stop_token_ids=stops, logprobs=0, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY,
            )
            final = None
            async for output in self.llm.generate({"prompt_token_ids": prompt}, params, request_id=uuid.uuid4().hex):
                final = output
            return [completion_of(c, stops) for c in sorted(final.outputs, key=lambda c: c.index)]

        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))

    async def join_channel(self, channel_id, backend, rendezvous, rank, world_size, timeout_s) -> None:
        if backend != "nccl":
            raise ValueError(f"the vllm engine joins nccl channels only, not {backend!r}")
        await self.llm.collective_rpc("meshrl_join_channel", timeout=timeout_s + 10,
                                      args=(channel_id, bytes(rendezvous), rank, world_size, timeout_s))

    async def receive_weights(self, channel_id: str, timeout_s: float) -> int:
        """Pause generation (requests in flight finish first; the prefix cache is cleared, so nothing computed
        under the old weights is reused), receive and load the weights in every worker, resume."""
        started = time.perf_counter()
        await self.pause()
        paused = time.perf_counter()
        try:
            versions = await self.llm.collective_rpc("meshrl_receive_weights", timeout=timeout_s + 10,
                                                     args=(channel_id, timeout_s))
            received = time.perf_counter()
        finally:
            await self.llm.resume_generation()
        self.last_sync = SyncTimings(paused - started, received - paused, time.perf_counter() - started)
        if len(set(versions)) != 1:
            raise RuntimeError(f"vLLM workers loaded different weight versions: {versions}")
        return versions[0]

    async def pause(self) -> None:
        """Stop scheduling once the requests in flight are done, and clear the prefix cache.

        ``AsyncLLM.pause_generation`` does this through the engine core and then sleeps 20 ms so that the last
        outputs reach their callers first (vLLM 0.20.1: "not required for correctness"); a sync waits for
        the engine core alone."""
        pause_scheduler = getattr(self.llm.engine_core, "pause_scheduler_async", None)
        if pause_scheduler is None:
            await self.llm.pause_generation(mode="wait", clear_cache=True)
        else:
            await pause_scheduler(mode="wait", clear_cache=True)

    async def checksums(self) -> list[dict[str, int]]:
        """Each worker's checksum of each of its parameters (tests compare them with the trainer's)."""
        return await self.llm.collective_rpc("meshrl_weight_checksums")

    async def sleep(self) -> None:
        await self.llm.sleep(level=1)

    async def wake_up(self) -> None:
        await self.llm.wake_up()

    async def close(self) -> None:
        await asyncio.to_thread(self.llm.shutdown)


def completion_of(output, stops: list[int]) -> Completion:
    """Our Completion from a vLLM CompletionOutput: token ids, the sampled tokens' logprobs, the finish."""
    tokens = list(output.token_ids)
    logprobs = [output.logprobs[i][token].logprob for i, token in enumerate(tokens)]
    finished_by_stop = output.finish_reason == "stop" or (tokens and tokens[-1] in stops)
    return Completion(tokens, logprobs, "stop" if finished_by_stop else "length")


async def receive_raw(engine: VLLMEngine, channel_id: str, nbytes: int, timeout_s: float) -> None:
    """The workers receive one plain broadcast of ``nbytes`` (the reference the sync benchmark compares to)."""
    await engine.llm.collective_rpc("meshrl_receive_raw", timeout=timeout_s + 10, args=(channel_id, nbytes, timeout_s))


def vllm_layout(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors vLLM holds (tensor parallel size 1) after ``load_weights`` of these HF-named Qwen2/Llama
    tensors: q/k/v and gate/up stacked along dim 0, everything else as it is."""
    import torch

    layout = {}
    for name, tensor in named.items():
        for fused, parts in STACKED:
            if any(f".{part}." in name for part in parts):
                if f".{parts[0]}." in name:
                    layout[name.replace(f".{parts[0]}.", f".{fused}.")] = torch.cat(
                        [named[name.replace(f".{parts[0]}.", f".{part}.")] for part in parts])
                break
        else:
            layout[name] = tensor
    return layout
