"""The critic section (verl's ``critic``): the value model of GAE, its body, loss, batches and optimizer."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, PositiveFloat, PositiveInt

from services.algo_names import LossAggMode
from services.common.config import Section
from services.run.sections.fsdp import FSDPConfig
from services.run.sections.lora import LoraKeys
from services.run.sections.optim import OptimConfig


class CriticModelConfig(LoraKeys):
    """The critic's body; with lora_rank > 0 it trains LoRA adapters on it and its value head whole."""

    path: str = ""
    """Local model folder of the critic's body; empty = the actor's model (a value head is added)."""
    enable_gradient_checkpointing: bool = False
    """As actor_rollout_ref.model.enable_gradient_checkpointing, for the critic."""
    use_remove_padding: bool | None = None
    """As actor_rollout_ref.model.use_remove_padding, for the critic (null: packed on a GPU)."""
    fsdp_config: FSDPConfig = FSDPConfig()
    """How the trainer holds the critic."""


class CriticConfig(Section):
    enable: bool | None = None
    """Use a critic: null = only when algorithm.adv_estimator is gae."""
    model: CriticModelConfig = CriticModelConfig()
    optim: OptimConfig = OptimConfig(lr=1e-5)
    ppo_mini_batch_size: PositiveInt | None = None
    """Prompts per critic optimizer step; null = the actor's."""
    ppo_micro_batch_size_per_gpu: PositiveInt = 64
    """Sequences per forward/backward (and per forward pass of the values) on one rank."""
    use_dynamic_bsz: bool = False
    """Cut micro-batches by a token budget instead of a count of sequences (see the actor's)."""
    ppo_max_token_len_per_gpu: PositiveInt = 32768
    """With use_dynamic_bsz: token budget of a micro-batch of the critic's update, counted as the actor's."""
    forward_max_token_len_per_gpu: PositiveInt | None = None
    """With use_dynamic_bsz: token budget of the values' forward passes; null = ppo_max_token_len_per_gpu."""
    ppo_epochs: PositiveInt | None = None
    """Null = the actor's."""
    cliprange_value: float = Field(0.5, gt=0)
    """Clip range of the new value around the old one."""
    vf_coef: float = Field(1.0, gt=0)
    """Weight of the value loss."""
    loss_agg_mode: LossAggMode = "token-mean"
    """How the per-token clipped value losses become one number; the modes of the actor's loss_agg_mode."""
    grad_clip: PositiveFloat = 1.0
    """Max global gradient norm of the critic: larger gradients are scaled down to it before each optimizer
    step (critic/grad_norm logs the norm before clipping)."""
    strategy: Literal["auto", "fsdp2", "none"] = "auto"
    """As actor_rollout_ref.actor.strategy, for the critic (its fsdp_config is critic.model.fsdp_config)."""
