"""The actor_rollout_ref section (verl's): the model every role starts from, and its three parts, the actor
(services/run/sections/actor.py), the rollout (services/run/sections/rollout.py) and the frozen reference."""

from __future__ import annotations

from typing import Literal

from pydantic import NonNegativeInt, PositiveInt

from services.common.config import Section
from services.run.sections.actor import ActorConfig
from services.run.sections.fsdp import FSDPConfig
from services.run.sections.lora import ActorLoraKeys
from services.run.sections.rollout import RolloutConfig


class ModelConfig(ActorLoraKeys):
    """The model every role starts from; with lora_rank > 0 the actor trains LoRA adapters on it (the keys of
    services/run/sections/lora.py) and the reference is this model with the adapters switched off."""

    path: str = ""
    """Local Hugging Face model folder (config.json, weights, tokenizer). Filled in by --local."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype of the weights on the rollout engine, and on the trainer unless its fsdp_config.mixed_precision is
    set (then the trainer keeps fp32 master weights and sends the rollout its weights cast to this dtype)."""
    allow_pickle: bool = False
    """Load a model folder whose weights are pickled (pytorch_model.bin, *.pt) when it has no safetensors: a
    pickle can run code when loaded, so this is refused unless set, for the actor's, reference's, critic's and
    rollouts' model folders alike."""
    enable_gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass instead of keeping them (less memory,
    about a third more compute)."""
    use_remove_padding: bool | None = None
    """The trainer packs each micro-batch's sequences into one row instead of padding every row to the longest
    (no pad token is computed; the outputs are the same), and its attention runs per sequence: on a GPU in bf16 or
    fp16 the flash kernel's variable-length form, elsewhere SDPA on each sequence. Null: packed where the trainer
    runs on a GPU, padded on a CPU."""
    logprob_chunk_tokens: NonNegativeInt = 1024
    """The trainer computes logprobs and entropies (actor and reference) from the final hidden states of the
    response tokens, through the output layer this many tokens at a time, recomputing each chunk's logits in the
    backward pass: the fp32 logits it holds are chunk x vocabulary (1024 x 152k: 0.6 GB) instead of the whole
    micro-batch's. Larger chunks make fewer, larger matrix products; 0 = the whole micro-batch's logits at once
    (also what a model whose logits are not its output layer's alone, e.g. soft-capped, always gets)."""


class RefConfig(Section):
    """The frozen reference policy (verl's actor_rollout_ref.ref): its passes and how the trainer holds it."""

    log_prob_micro_batch_size_per_gpu: PositiveInt | None = None
    """Sequences per forward pass of the reference logprobs; null = the rollout's
    log_prob_micro_batch_size_per_gpu (then the actor's ppo_micro_batch_size_per_gpu)."""
    log_prob_use_dynamic_bsz: bool | None = None
    """Cut those passes by a token budget; null = the rollout's log_prob_use_dynamic_bsz."""
    log_prob_max_token_len_per_gpu: PositiveInt | None = None
    """Their token budget; null = the rollout's log_prob_max_token_len_per_gpu."""
    fsdp_config: FSDPConfig | None = None
    """How the trainer holds the reference (param_offload: its weights in CPU memory between passes); null =
    the actor's fsdp_config."""


class ActorRolloutRefConfig(Section):
    model: ModelConfig = ModelConfig()
    """The model every role starts from (actor, reference; the rollout serves it)."""
    actor: ActorConfig = ActorConfig()
    """The policy being trained."""
    rollout: RolloutConfig = RolloutConfig()
    """Sampling, and the rollout-side settings of the trainer's logprob passes."""
    ref: RefConfig = RefConfig()
    """The reference policy (used with actor.use_kl_loss or algorithm.use_kl_in_reward)."""
    hybrid_engine: bool | None = None
    """verl's actor and rollout in one process (its only mode). meshrl's rollouts are services of their own,
    which may share the trainer's GPUs (rollout.free_cache_engine); reported as not used."""
