"""The algorithm section (verl's ``algorithm``): the advantage estimator, the KL penalty in the reward and its
controller, DAPO's group filter, and the rollout-correction importance weights."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, PositiveFloat, PositiveInt

from services.algo_names import KLEstimator, RolloutISLevel, RolloutISMode
from services.common.config import Section


GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus_baseline", "opo", "gpg", "grpo_passk")  # built-ins that
# compare the responses to one prompt


class KLControlConfig(Section):
    type: Literal["fixed", "adaptive"] = "fixed"
    """fixed: kl_coef stays; adaptive: moves kl_coef toward target_kl over horizon samples."""
    kl_coef: float = Field(0.001, ge=0)
    """With algorithm.use_kl_in_reward: every token's reward loses kl_coef * its KL estimate. With type
    adaptive this is the starting value; the current one is logged as actor/reward_kl_penalty_coeff and kept
    in checkpoints (verl's algorithm.kl_ctrl.kl_coef)."""
    target_kl: PositiveFloat = 0.1
    """Adaptive: the KL the coefficient steers toward, measured each step as the batch mean of each response's
    per-token mean KL estimate (actor/reward_kl_penalty). kl_coef is multiplied by
    1 + clip(KL / target_kl - 1, -0.2, 0.2) * responses / horizon."""
    horizon: PositiveInt = 10000
    """Adaptive: responses over which the clipped proportional error acts in full; a step of N responses moves
    kl_coef by that error times N / horizon."""


class FilterGroupsConfig(Section):
    enable: bool = False
    """DAPO dynamic sampling: drop prompts whose responses all scored the same, generate more to refill."""
    max_num_gen_batches: PositiveInt = 4
    """Most generation rounds per step (the first included); the step trains on what it has then."""


class RolloutCorrectionConfig(Section):
    """Importance weights on the mismatch between the rollout engine's policy and the trainer's (verl's
    rollout_correction, TRL's vllm_importance_sampling_correction): each token's policy-gradient loss is
    multiplied by pi_old / pi_rollout. The mismatch metrics (training/rollout_*) are logged either way."""

    enable: Literal["auto"] | bool = "auto"
    """auto: on whenever trainer.async_.max_staleness > 0; true or false forces it (the rollout's logprobs
    then travel with every actor update)."""
    rollout_is: RolloutISLevel = "token"
    """Level of the weights: token = each token's own ratio; sequence = the product of a response's token
    ratios, the same for all its tokens."""
    rollout_is_mode: RolloutISMode = "truncate"
    """What happens to a ratio above rollout_is_threshold: truncate = clamped to it (TIS); mask = set to 0,
    so the token (sequence level: the response) drops out of the policy gradient."""
    rollout_is_threshold: PositiveFloat = 2.0
    """Upper bound C of the ratio (verl's default 2.0; sequence-level ratios usually want more)."""


class AlgorithmConfig(Section):
    adv_estimator: str = Field("grpo", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    """Advantage estimator, by the name the coordinator registered it under: gae (with a critic), grpo, rloo,
    reinforce_plus_plus, reinforce_plus_plus_baseline, opo, gpg, grpo_passk, remax (a greedy response to each
    prompt is generated and scored as the baseline), or one the coordinator's adv_estimator_modules register.
    A name the coordinator has not registered is refused at start, with the names it has."""
    gamma: float = Field(1.0, ge=0, le=1)
    """Discount (gae, reinforce_plus_plus)."""
    lam: float = Field(1.0, ge=0, le=1)
    """GAE lambda."""
    norm_adv_by_std_in_grpo: bool = True
    """Divide by the group's std (GRPO) or only subtract its mean (Dr. GRPO)."""
    use_kl_in_reward: bool = False
    """Subtract kl_ctrl.kl_coef * KL(old policy || reference) from every token's reward; needs a reference."""
    kl_penalty: KLEstimator = "kl"
    """KL estimator of the reward penalty."""
    kl_ctrl: KLControlConfig = KLControlConfig()
    filter_groups: FilterGroupsConfig = FilterGroupsConfig()
    rollout_correction: RolloutCorrectionConfig = RolloutCorrectionConfig()
