"""From a run config to the trainer's roles: actor, critic, reference, and their settings."""

from __future__ import annotations

import torch

from services.common.models import load_causal_lm, load_tokenizer, load_value_model
from services.common.run_config import OptimConfig, RunConfig
from services.trainer.actor import Actor, ActorSettings
from services.trainer.critic import Critic, CriticSettings
from services.trainer.optim import OptimSettings

ROLES = ("actor", "critic", "ref")


def optim_settings(optim: OptimConfig, grad_clip: float, total_steps: int) -> OptimSettings:
    return OptimSettings(optim.lr, optim.weight_decay, tuple(optim.betas), grad_clip, optim.lr_warmup_steps,
                         optim.warmup_style, optim.min_lr_ratio, total_steps)


def pad_id_of(model_path: str) -> int:
    tokenizer = load_tokenizer(model_path)
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def build_actor(config: RunConfig, seed: int, device: str) -> Actor:
    """The actor model named by the run config, with its optimizer; seeded from ``seed``."""
    model_config, actor = config.actor_rollout_ref.model, config.actor_rollout_ref.actor
    torch.manual_seed(seed)
    model = load_causal_lm(model_config.path, model_config.dtype).to(device)
    optim = optim_settings(actor.optim, actor.grad_clip, config.trainer.total_training_steps)
    return Actor(model, optim, actor.warm_start.lr, pad_id_of(model_config.path), seed)


def build_critic(config: RunConfig, seed: int, device: str) -> Critic:
    """A value model on the critic's body (the actor's model unless critic.model.path says otherwise)."""
    path = config.critic.model.path or config.actor_rollout_ref.model.path
    torch.manual_seed(seed + 1)
    model = load_value_model(path, config.actor_rollout_ref.model.dtype).to(device)
    optim = optim_settings(config.critic.optim, config.critic.grad_clip, config.trainer.total_training_steps)
    return Critic(model, optim, pad_id_of(path), seed)


def build_reference(config: RunConfig, device: str) -> torch.nn.Module:
    """The frozen reference policy: the actor's initial model, never updated."""
    model_config = config.actor_rollout_ref.model
    model = load_causal_lm(model_config.path, model_config.dtype).to(device).eval()
    model.requires_grad_(False)
    return model


def actor_settings(config: RunConfig) -> ActorSettings:
    """Mini-batches are configured in prompts (as in verl); the actor counts sequences."""
    actor = config.actor_rollout_ref.actor
    n = config.actor_rollout_ref.rollout.n
    correction = config.algorithm.rollout_correction
    return ActorSettings(
        mini_batch_size=actor.ppo_mini_batch_size * n,
        micro_batch_size=actor.ppo_micro_batch_size_per_gpu,
        epochs=actor.ppo_epochs,
        clip_ratio_low=actor.clip_ratio_low,
        clip_ratio_high=actor.clip_ratio_high,
        clip_ratio_c=actor.clip_ratio_c,
        loss_agg_mode=actor.loss_agg_mode,
        entropy_coeff=actor.entropy_coeff,
        use_kl_loss=actor.use_kl_loss,
        kl_loss_coef=actor.kl_loss_coef,
        kl_loss_type=actor.kl_loss_type,
        temperature=config.actor_rollout_ref.rollout.temperature,
        max_response_length=config.data.max_response_length,
        rollout_is=correction.rollout_is if config.use_rollout_correction else None,
        rollout_is_mode=correction.rollout_is_mode,
        rollout_is_threshold=correction.rollout_is_threshold,
    )


def critic_settings(config: RunConfig) -> CriticSettings:
    critic, actor = config.critic, config.actor_rollout_ref.actor
    return CriticSettings(
        mini_batch_size=(critic.ppo_mini_batch_size or actor.ppo_mini_batch_size) * config.actor_rollout_ref.rollout.n,
        micro_batch_size=critic.ppo_micro_batch_size_per_gpu,
        epochs=critic.ppo_epochs or actor.ppo_epochs,
        cliprange_value=critic.cliprange_value,
        vf_coef=critic.vf_coef,
        loss_agg_mode=critic.loss_agg_mode,
        max_response_length=config.data.max_response_length,
    )
