"""The actor (verl's ``actor_rollout_ref.actor``): the policy being trained, its PPO loss, its batches, its
optimizer, how the trainer holds it, and the supervised warm start before RL."""

from __future__ import annotations

from typing import Literal

import pydantic
from pydantic import Field, PositiveFloat, PositiveInt

from services.algo_names import KLEstimator, LossAggMode
from services.common.config import Section
from services.run.sections.fsdp import FSDPConfig
from services.run.sections.optim import OptimConfig


class WarmStartConfig(Section):
    steps: int = Field(0, ge=0)
    """Supervised steps before RL (0 = none), a stand-in for an SFT model: each response taught is the row's
    worked solution, extra_info.answer (as verl's GSM8K preprocessing keeps it), else its ground truth; a row
    with extra_info.turns (a worked multi-turn trajectory: assistant and tool messages) is taught as the agent
    loop would build it, the tool replies untrained."""
    batch_size: PositiveInt = 64
    """Prompts per supervised step."""
    lr: PositiveFloat = 3e-3
    """Peak learning rate of the warm start's own AdamW (betas and grad_clip as the actor's, no weight decay)."""
    lr_warmup_steps: int = Field(0, ge=0)
    """Warm-start steps W of linear warm-up (0 = none): step k (1-based) runs at lr * k / W up to k = W, as the
    actor's optim.lr_warmup_steps."""
    warmup_style: Literal["constant", "cosine"] = "constant"
    """After the warm-up: constant, or cosine decay to min_lr_ratio * lr at the warm start's last step."""
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    """Floor of the cosine decay, as a fraction of lr."""
    full_weights: bool = True
    """With LoRA (actor_rollout_ref.model.lora_rank > 0): the warm start trains the model's full weights, as the
    SFT model it stands in for was trained, and RL's adapters learn on top of them. That warm-started base is
    then the reference (the adapters switched off), checkpoints hold it beside the adapters, and each sync sends
    the whole model with the adapters merged in, which rollouts serve as full weights (as with lora.merge). false:
    the warm start trains the adapters alone, on the model folder's frozen base. Changes nothing without LoRA or
    without warm-start steps."""
    own_rows: bool = False
    """Teach rows that RL never draws: steps x batch_size rows of the training data, chosen by a seeded shuffle,
    are the warm start's (each taught once) and RL's batches come from the rest, so RL does not spend its steps
    on problems whose answers were just taught."""


class PolicyLossConfig(Section):
    """Which policy loss the actor minimises, and the parameters of those that take some (verl's
    actor.policy_loss). Every loss also reads the actor's clip_ratio_low/high (vanilla: clip_ratio_c too)."""

    loss_mode: str = Field("vanilla", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    """The policy loss, by the name a trainer registered it under: vanilla (PPO's clipped surrogate), gspo
    (sequence-level ratio and clipping), cispo (clipped, detached importance weight on every token), geo_mean
    (GMPO: geometric mean of the token ratios), clip_cov and kl_cov (entropy-preserving: detach, or penalise
    the KL of, the tokens of largest advantage-logprob covariance), gpg (plain policy gradient), or one a
    trainer's policy_loss_modules register. A run naming a loss no trainer has is refused at start, with the
    names they have (coordctl services lists them)."""
    clip_cov_ratio: float = Field(0.0002, gt=0, le=1)
    """clip_cov: share of the micro-batch's trained tokens taken out of the loss (at least one)."""
    clip_cov_lb: float = 1.0
    """clip_cov: tokens whose centred covariance (A - mean A)(log pi - mean log pi) is above this..."""
    clip_cov_ub: float = 5.0
    """clip_cov: ...and below this are the candidates to take out."""
    kl_cov_ratio: float = Field(0.0002, gt=0, le=1)
    """kl_cov: share of the micro-batch's trained tokens (those of largest covariance, at least one) whose loss
    gains ppo_kl_coef * |log ratio|."""
    ppo_kl_coef: float = Field(0.1, ge=0)
    """kl_cov: weight of the |log ratio| penalty on the tokens it picks."""

    @pydantic.model_validator(mode="after")
    def _bounds_in_order(self) -> PolicyLossConfig:
        if self.clip_cov_lb >= self.clip_cov_ub:
            raise ValueError(f"actor_rollout_ref.actor.policy_loss.clip_cov_lb ({self.clip_cov_lb}) must be below "
                             f"clip_cov_ub ({self.clip_cov_ub})")
        return self


class RouterReplayConfig(Section):
    """Routing replay for a mixture-of-experts model (verl's actor.router_replay; docs/guides/moe.md)."""

    mode: Literal["disabled", "R3"] = "disabled"
    """R3 (rollout routing replay): the rollouts record the experts each token was routed to, they travel with
    the sample, and the actor's logprob and update passes route by them instead of by their own routers (the
    routers' softmax still weighs the chosen experts, so the routers still learn); disabled: each engine routes
    by its own router. R3 needs an MoE model and hf rollouts (vLLM's routes are not wired yet). verl's R2 (replay
    the old-logprob pass's routes) is not offered."""


class ActorConfig(Section):
    optim: OptimConfig = OptimConfig()
    ppo_mini_batch_size: PositiveInt = 16
    """Prompts per optimizer step (each with its rollout.n responses)."""
    ppo_micro_batch_size_per_gpu: PositiveInt = 64
    """Sequences per forward/backward on one rank; gradients are accumulated over a mini-batch."""
    use_dynamic_bsz: bool = False
    """Cut micro-batches by a token budget (ppo_max_token_len_per_gpu) instead of a count of sequences."""
    ppo_max_token_len_per_gpu: PositiveInt = 16384
    """With use_dynamic_bsz: most tokens a micro-batch holds on one rank, counted as the forward pass holds
    them: all tokens of its sequences when the passes pack (model.use_remove_padding; by default on a GPU), else
    rows x its longest row (sequences are taken longest first, so little padding is counted). Must fit the
    longest sequence, data.max_prompt_length + data.max_response_length."""
    ppo_epochs: PositiveInt = 1
    """Passes over each step's batch in the actor's update: each pass reshuffles the batch's responses and cuts
    them into mini-batches of ppo_mini_batch_size x rollout.n responses, one optimizer step each. The
    learning-rate schedule still advances once per step."""
    recompute_old_log_prob: bool | None = None
    """Compute the old policy's logprobs (pi_old of the PPO ratio) in a no-grad pass over the batch before the
    update (timing_s/old_log_prob). null = only where the update needs them: when it is one optimizer step over
    the whole batch (ppo_epochs 1, ppo_mini_batch_size = data.train_batch_size) and no
    algorithm.use_kl_in_reward, pi_old is the weights the update starts from, and the update takes its own
    logprobs, detached, instead (the ratio is 1; the rollout correction still compares with the rollout's);
    true = always; false = never, refused where the update needs them."""
    clip_ratio_low: float = Field(0.2, gt=0, lt=1)
    """PPO clip range below 1."""
    clip_ratio_high: float = Field(0.2, gt=0)
    """PPO clip range above 1 (raise it for DAPO's clip-higher)."""
    clip_ratio_c: float | None = Field(3.0, gt=1)
    """Dual-clip bound for negative advantages (null disables dual-clip)."""
    loss_agg_mode: LossAggMode | None = None
    """How per-token losses (policy, entropy, KL) become one number; seq-mean-token-sum-norm is Dr. GRPO. null =
    the one the policy loss's paper prescribes: token-mean for vanilla, cispo, clip_cov, kl_cov and gpg,
    seq-mean-token-mean for gspo and geo_mean (whose policy term is always a mean over responses)."""
    policy_loss: PolicyLossConfig = PolicyLossConfig()
    entropy_coeff: float = Field(0.0, ge=0)
    """Weight of the entropy bonus (subtracted from the loss)."""
    use_kl_loss: bool = False
    """Add kl_loss_coef * KL(actor || reference) to the loss (GRPO's way); needs a reference."""
    kl_loss_coef: float = Field(0.001, ge=0)
    """With use_kl_loss: weight of the KL term added to the actor's loss, kl_loss_coef * the kl_loss_type
    estimate of KL(actor || reference) aggregated as the loss is (loss_agg_mode); logged as actor/kl_loss."""
    kl_loss_type: KLEstimator = "low_var_kl"
    """KL estimator of the loss term."""
    grad_clip: PositiveFloat = 1.0
    """Max global gradient norm."""
    warm_start: WarmStartConfig = WarmStartConfig()
    strategy: Literal["auto", "fsdp2", "none"] = "auto"
    """How the trainer holds the actor: fsdp2 = sharded over the trainer's ranks (torchrun) with FSDP2, on one
    rank too; none = whole on one rank, refused on a trainer of several ranks; auto = fsdp2 when the trainer
    runs several ranks or fsdp_config asks for mixed precision or parameter offload, else none (so one CPU
    rank trains as fast as without FSDP)."""
    fsdp_config: FSDPConfig = FSDPConfig()
    """How the trainer holds the actor; the reference follows the actor's strategy and fsdp_config."""
    router_replay: RouterReplayConfig = RouterReplayConfig()
