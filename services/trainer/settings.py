"""From a run config to the plain settings of the trainer's ops: micro-batching, and the actor's and critic's
updates. Each value is named for what the code does with it.

Each rank builds a run's ``RunSettings`` once, when InitRun loads it; the ops read them, never the run config.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.algo_registry import POLICY_LOSSES
from services.common.wire import DTYPES
from services.run.config import RunConfig
from services.trainer.actor import ActorSettings
from services.trainer.batching import MicroBatching
from services.trainer.critic import CriticSettings


@dataclass(frozen=True, kw_only=True)
class RunSettings:
    """What the trainer's ops do for the run loaded, on this rank's device."""

    model_path: str  # the actor's model folder (Info reports it)
    temperature: float  # the rollout's sampling temperature, which the logprob passes divide the logits by
    actor_log_probs: MicroBatching  # micro-batches of the actor's (old) logprob pass
    ref_log_probs: MicroBatching  # micro-batches of the reference's logprob pass
    values: MicroBatching  # micro-batches of the critic's value pass
    actor: ActorSettings  # the actor's update; its micro-batches are also the warm start's
    critic: CriticSettings  # the critic's update
    weights_dtype: torch.dtype  # the rollout's: what the actor's weights are broadcast in
    free_cache: bool  # give cached GPU memory back after each model op (colocated: rollout.free_cache_engine)


def run_settings(config: RunConfig, device: torch.device) -> RunSettings:
    """The run's settings on ``device``; built once per InitRun."""
    model, rollout = config.actor_rollout_ref.model, config.actor_rollout_ref.rollout
    return RunSettings(
        model_path=model.path, temperature=rollout.temperature,
        actor_log_probs=log_prob_micro(config, device, "actor"), ref_log_probs=log_prob_micro(config, device, "ref"),
        values=values_micro(config, device), actor=actor_settings(config, device),
        critic=critic_settings(config, device), weights_dtype=DTYPES[model.dtype], free_cache=rollout.free_cache_engine,
    )


def packs(use_remove_padding: bool | None, device: torch.device) -> bool:
    """Whether a model's forward passes pack their sequences into one row (use_remove_padding): as configured, or,
    where it is null, when the trainer computes on a GPU (whose varlen attention kernel then skips every pad)."""
    return device.type == "cuda" if use_remove_padding is None else use_remove_padding


def log_prob_micro(config: RunConfig, device: torch.device, role: str = "actor") -> MicroBatching:
    """Micro-batches of the old (actor) or reference (ref) logprob passes on ``device``: verl's rollout.log_prob_*
    keys, and for the reference its own ref.log_prob_* where set."""
    actor_rollout_ref = config.actor_rollout_ref
    actor, rollout, ref = actor_rollout_ref.actor, actor_rollout_ref.rollout, actor_rollout_ref.ref
    size = rollout.log_prob_micro_batch_size_per_gpu
    dynamic = rollout.log_prob_use_dynamic_bsz
    budget = rollout.log_prob_max_token_len_per_gpu
    if role == "ref":
        size = ref.log_prob_micro_batch_size_per_gpu or size
        dynamic = ref.log_prob_use_dynamic_bsz if ref.log_prob_use_dynamic_bsz is not None else dynamic
        budget = ref.log_prob_max_token_len_per_gpu or budget
    dynamic = actor.use_dynamic_bsz if dynamic is None else dynamic
    return MicroBatching(size=size or actor.ppo_micro_batch_size_per_gpu,
                         max_tokens=(budget or actor.ppo_max_token_len_per_gpu) if dynamic else None,
                         remove_padding=packs(actor_rollout_ref.model.use_remove_padding, device),
                         chunk_tokens=actor_rollout_ref.model.logprob_chunk_tokens,
                         replay_routes=role == "actor" and actor.router_replay.mode == "R3")


def values_micro(config: RunConfig, device: torch.device) -> MicroBatching:
    """Micro-batches of the critic's value passes on ``device``."""
    critic = config.critic
    budget = critic.forward_max_token_len_per_gpu or critic.ppo_max_token_len_per_gpu
    return MicroBatching(size=critic.ppo_micro_batch_size_per_gpu,
                         max_tokens=budget if critic.use_dynamic_bsz else None,
                         remove_padding=packs(critic.model.use_remove_padding, device))


def actor_settings(config: RunConfig, device: torch.device) -> ActorSettings:
    """The actor's update on ``device``. Mini-batches are configured in prompts (as in verl); the actor counts
    sequences."""
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
        loss_agg_mode=actor.loss_agg_mode or POLICY_LOSSES.get(actor.policy_loss.loss_mode).loss_agg_mode,
        entropy_coeff=actor.entropy_coeff,
        use_kl_loss=actor.use_kl_loss,
        kl_loss_coef=actor.kl_loss_coef,
        kl_loss_type=actor.kl_loss_type,
        temperature=config.actor_rollout_ref.rollout.temperature,
        max_response_length=config.data.max_response_length,
        rollout_is=correction.rollout_is if config.use_rollout_correction else None,
        rollout_is_mode=correction.rollout_is_mode,
        rollout_is_threshold=correction.rollout_is_threshold,
        max_token_len=actor.ppo_max_token_len_per_gpu if actor.use_dynamic_bsz else None,
        remove_padding=packs(config.actor_rollout_ref.model.use_remove_padding, device),
        logprob_chunk_tokens=config.actor_rollout_ref.model.logprob_chunk_tokens,
        loss_mode=actor.policy_loss.loss_mode, clip_cov_ratio=actor.policy_loss.clip_cov_ratio,
        clip_cov_lb=actor.policy_loss.clip_cov_lb, clip_cov_ub=actor.policy_loss.clip_cov_ub,
        kl_cov_ratio=actor.policy_loss.kl_cov_ratio, ppo_kl_coef=actor.policy_loss.ppo_kl_coef,
        replay_routes=actor.router_replay.mode == "R3",
    )


def critic_settings(config: RunConfig, device: torch.device) -> CriticSettings:
    critic, actor = config.critic, config.actor_rollout_ref.actor
    return CriticSettings(
        mini_batch_size=(critic.ppo_mini_batch_size or actor.ppo_mini_batch_size) * config.actor_rollout_ref.rollout.n,
        micro_batch_size=critic.ppo_micro_batch_size_per_gpu,
        epochs=critic.ppo_epochs or actor.ppo_epochs,
        cliprange_value=critic.cliprange_value,
        vf_coef=critic.vf_coef,
        loss_agg_mode=critic.loss_agg_mode,
        max_response_length=config.data.max_response_length,
        max_token_len=critic.ppo_max_token_len_per_gpu if critic.use_dynamic_bsz else None,
        remove_padding=packs(critic.model.use_remove_padding, device),
    )
