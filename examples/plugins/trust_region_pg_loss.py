"""A user's policy loss: plain policy gradient (-A log pi), but a token whose ratio pi / pi_old has already
moved past the clip range in the direction its advantage pushes stops pulling (PPO's trust region, on REINFORCE).

Load it in the trainer's config (never a run's):   policy_loss_modules: [examples/plugins/trust_region_pg_loss.py]
Choose it in a run:                                 actor_rollout_ref.actor.policy_loss.loss_mode=trust_region_pg
"""

import torch

from services import algos
from services.algo_registry import PolicyLossInputs, PolicyLossOutput, PolicyLossParams, register_policy_loss


@register_policy_loss("trust_region_pg", loss_agg_mode="token-mean")
def trust_region_pg(inputs: PolicyLossInputs, params: PolicyLossParams) -> PolicyLossOutput:
    log_ratio = (inputs.logprobs - inputs.old_logprobs).detach()
    ratio, advantages = torch.exp(log_ratio), inputs.advantages
    past = (((advantages > 0) & (ratio > 1 + params.clip_ratio_high))
            | ((advantages < 0) & (ratio < 1 - params.clip_ratio_low)))
    per_token = torch.where(past, torch.zeros_like(ratio), -advantages * inputs.logprobs)
    if inputs.is_weights is not None:  # rollout correction, when the run turns it on
        per_token = per_token * inputs.is_weights
    loss = algos.aggregate(per_token, inputs.lengths, params.loss_agg_mode, scale=params.scale, mask=inputs.mask)
    tokens = max(params.scale.num_tokens, 1)  # metrics are this micro-batch's share of the mini-batch's mean
    return PolicyLossOutput(loss, {
        "actor/pg_clipfrac": float(algos.masked(past.double(), inputs.mask).sum()) / tokens,
        "actor/ppo_kl": float(algos.masked(-log_ratio, inputs.mask).sum()) / tokens,
    })
