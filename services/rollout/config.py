"""Settings of a rollout service process."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, PositiveInt

from services.common.config import StreamingServeConfig


CORRUPTION = 0.5  # what corrupt_weight_after_sync adds to its parameter after each sync


class RolloutServiceConfig(StreamingServeConfig):
    engine: Literal["hf", "vllm"] = "hf"
    """Inference engine: hf (transformers, CPU or GPU) or vllm (GPU)."""
    batch_size: PositiveInt = 256
    """Sequences sampled together in one forward pass (hf engine)."""
    device: str = "cpu"
    """torch device of the hf engine; vllm uses the GPUs CUDA_VISIBLE_DEVICES shows it."""
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1)
    """Share of each GPU vLLM may take (weights, activations, KV cache)."""
    tensor_parallel_size: PositiveInt = 1
    """GPUs one vLLM engine spans; every worker receives the full weights and reslices them."""
    enforce_eager: bool = False
    """vLLM without CUDA graphs: starts in about 23 s instead of 70 s, generates slower."""
    enable_sleep_mode: bool = False
    """Allow Sleep/WakeUp (a trainer and this rollout sharing one GPU)."""
    moe_backend: Literal["auto", "triton", "flashinfer_cutlass"] = "auto"
    """vLLM's fused-MoE kernel for a bf16/fp16 mixture of experts (its moe_backend): auto (vLLM 0.20 picks
    FlashInfer's CUTLASS kernel where it runs, e.g. on an H100, else Triton) or one of the two, whose expert
    layouts differ (each expert's gate and up rows swapped in CUTLASS's)."""
    colocated: bool | None = None
    """Whether this rollout shares its device with the run's actor trainer, so that it sleeps while the trainer
    works (with actor_rollout_ref.rollout.free_cache_engine) and takes the weights on a channel of its own.
    null = as found: on a GPU trainer, whether this engine works on the trainer's GPU; on a CPU trainer, yes.
    Say false for a rollout that should go on generating beside a CPU trainer."""
    max_num_seqs: PositiveInt = 1024
    """Sequences vLLM schedules at once (verl's rollout.max_num_seqs)."""
    max_num_batched_tokens: PositiveInt = 8192
    """Tokens vLLM processes in one step (verl's rollout.max_num_batched_tokens)."""
    enable_prefix_caching: bool = False
    """vLLM reuses the KV of prompt prefixes it has seen. Every weight sync must then clear that cache, a pass
    over every KV block (11 ms for the 56 GB cache of a 0.5B model at gpu_memory_utilization 0.4 on an H200),
    and the cache lives one step at most, since the weights change every step; worth it for long prompts shared
    by many samples."""
    batched_seeded_sampling: bool = True
    """vLLM: draw the sampling noise of every seeded sample of a decode step in one GPU kernel
    (services/rollout/seeded_sampling.py) instead of vLLM's one kernel launch per seeded sample. meshrl seeds
    every sample, so at 256 samples that is 256 launches a token. The samples follow the same distribution and
    stay reproducible by seed, but are not the ones vLLM's own generators draw (false: vLLM's own, as before
    2026-12-07). On an H100 at 32 prompts x 8 x 256 tokens: seeded LLM.generate took 1.100x the unseeded time with
    vLLM's sampling, 1.081x with this (bench/results/grpo-step-2026-12-07.md)."""
    max_model_len: PositiveInt | None = None
    """Longest prompt + response vLLM plans for (null = the model's)."""
    corrupt_weight_after_sync: str = ""
    """For tests of the weight check only: the parameter (as the model names it, e.g. model.norm.weight; on the hf
    engine also one expert's projection as a checkpoint names it, e.g.
    model.layers.0.mlp.experts.1.up_proj.weight) to which every sync adds CORRUPTION (0.5) once the weights arrived
    whole and passed their checksums, so that the engine
    computes with weights that are not the trainer's; empty (the default): none. Never set it in a real run."""
    max_request_bytes: PositiveInt = 64 << 20
    """Bytes one Generate request stream may send in all (its prompts: 64 MiB holds 8 million prompt tokens);
    what comes past it is dropped as it arrives, and the call refused with RESOURCE_EXHAUSTED."""
    max_n: PositiveInt = 1024
    """Most responses per prompt (params.n) one Generate call may ask for."""
    max_new_tokens: PositiveInt = 65_536
    """Longest response (params.max_new_tokens) one Generate call may ask for."""
    max_tokens_per_call: PositiveInt = 1 << 26
    """Most tokens one Generate call may ask for: prompts x n x max_new_tokens (67 million, e.g. 1024 prompts x
    16 x 4096; the coordinator sends each replica one call per batch). A larger call is refused with
    RESOURCE_EXHAUSTED before anything is generated."""

    def request_limits(self) -> dict[str, int]:
        """The limits it registers with, by setting: a coordinator refuses a run over them at StartRun."""
        return {"max_n": self.max_n, "max_new_tokens": self.max_new_tokens,
                "max_tokens_per_call": self.max_tokens_per_call}

    def compute_devices(self) -> tuple[str, ...]:
        if self.engine == "vllm":  # the first tensor_parallel_size GPUs it sees
            return tuple(f"cuda:{index}" for index in range(self.tensor_parallel_size))
        return (self.device,)
