"""From a run config to the trainer's objects: the actor and its PPO settings."""

from __future__ import annotations

import torch

from services.common.models import load_causal_lm, load_tokenizer
from services.common.run_config import RunConfig
from services.trainer.actor import Actor, OptimSettings, PPOSettings


def build_actor(config: RunConfig, seed: int, device: str) -> Actor:
    """Load the actor model and tokenizer ids named by the run config; seed everything from ``seed``."""
    model_config = config.actor_rollout_ref.model
    actor_config = config.actor_rollout_ref.actor
    torch.manual_seed(seed)
    tokenizer = load_tokenizer(model_config.path)
    model = load_causal_lm(model_config.path, model_config.dtype).to(device)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    optim = OptimSettings(
        lr=actor_config.optim.lr,
        weight_decay=actor_config.optim.weight_decay,
        betas=tuple(actor_config.optim.betas),
        grad_clip=actor_config.grad_clip,
        warmup_steps=actor_config.optim.lr_warmup_steps,
    )
    return Actor(model, optim, actor_config.warm_start.lr, pad_id, seed)


def ppo_settings(config: RunConfig) -> PPOSettings:
    """Mini-batches are configured in prompts (as in verl); the actor counts sequences."""
    actor = config.actor_rollout_ref.actor
    n = config.actor_rollout_ref.rollout.n
    return PPOSettings(
        mini_batch_size=actor.ppo_mini_batch_size * n,
        micro_batch_size=actor.ppo_micro_batch_size_per_gpu,
        epochs=actor.ppo_epochs,
        clip_ratio_low=actor.clip_ratio_low,
        clip_ratio_high=actor.clip_ratio_high,
        temperature=config.actor_rollout_ref.rollout.temperature,
    )
