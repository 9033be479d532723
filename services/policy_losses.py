"""The built-in policy losses, registered by name as a user's are (``services/algo_registry.py``); chosen by
``actor_rollout_ref.actor.policy_loss.loss_mode``.

Choices, stated before the code (r_t = pi(y_t) / pi_old(y_t), A_t the advantage, low/high the actor's
clip_ratio_low/high; each follows verl's core_algos.py and its paper):

- vanilla: PPO's clipped surrogate with clip-higher and dual-clip (``policy_loss``); token-mean.
- gspo (GSPO, arXiv:2507.18071): one ratio per response, s = exp(mean over its tokens of log r_t), clipped
  to [1 - low, 1 + high] as PPO clips a token's; each token's term is -A s_t with s_t = sg(s) pi / sg(pi)
  (equal to s, its gradient s grad log pi_t), log s_t capped at 10. The paper's clip ranges are tiny
  (3e-4 / 4e-4). Aggregated seq-mean-token-mean.
- cispo (CISPO, MiniMax-M1, arXiv:2506.13585): -sg(clip(r_t, 1 - low, 1 + high)) A_t log pi_t: the clipped
  ratio is a detached weight, so no token loses its gradient. token-mean.
- geo_mean (GMPO, arXiv:2507.20673): per response, -A exp(mean over its tokens of the clipped log-ratio),
  the log-ratio clipped to [-low, high] on the side the advantage's sign picks (PPO's min, in log space); A is
  the response's mean advantage. The loss is the mean over responses, whatever loss_agg_mode says. Rollout
  correction weighs a response by the geometric mean of its tokens' weights.
- clip_cov (Clip-Cov, arXiv:2505.22617): PPO's clipped surrogate (no dual-clip), where a random
  clip_cov_ratio of the micro-batch's trained tokens (at least one), among those PPO did not clip whose
  centred covariance (A - mean A)(log pi - mean log pi) lies in (clip_cov_lb, clip_cov_ub), are taken out of
  the loss (detached). actor/pg_clipfrac is the share taken out. token-mean.
- kl_cov (KL-Cov, same paper): -A r_t, plus ppo_kl_coef |log r_t| on the kl_cov_ratio of trained tokens (at
  least one) with the largest centred covariance. actor/ppo_kl is the mean |log r_t| there, as verl logs it.
  token-mean.
- gpg (GPG, arXiv:2504.02546): plain policy gradient -A_t log pi_t, no ratio or clipping. token-mean.

The covariance selections of clip_cov and kl_cov are over the micro-batch a call gets, as in verl. Every loss
multiplies each token's term by the rollout-correction weight where one is given, counts only the tokens of the
loss mask, and reports its metrics as shares of the mini-batch's token means (sums / scale.num_tokens), so the
micro-batches' shares add up.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from services import algos
from services.algo_registry import PolicyLossInputs, PolicyLossOutput, PolicyLossParams, register_policy_loss

GSPO_LOG_RATIO_CAP = 10.0  # verl's cap on log s_t, before exp


class PolicyLoss(NamedTuple):
    loss: torch.Tensor  # scalar, aggregated
    clipfrac: torch.Tensor  # share of tokens whose ratio was clipped (actor/pg_clipfrac)
    clipfrac_lower: torch.Tensor  # share of negative-advantage tokens capped by dual-clip
    approx_kl: torch.Tensor  # token mean of old_logprob - logprob (actor/ppo_kl)


def policy_loss(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, *, lengths: torch.Tensor,
    clip_ratio_low: float, clip_ratio_high: float, clip_ratio_c: float | None, mode: str, scale: algos.LossScale,
    is_weights: torch.Tensor | None = None, mask: torch.Tensor | None = None,
) -> PolicyLoss:
    """PPO clipped surrogate with clip-higher and dual-clip. Token tensors [T], lengths [B].

    l_t = max(-A r, -A clip(r, 1 - low, 1 + high)), r = exp(logp - old_logp) (log-ratio clamped to +-20);
    where A < 0 and clip_ratio_c is set: l_t = min(l_t, -A c). With ``is_weights`` [T] (rollout
    correction, from ``rollout_is_weights``) l_t becomes w_t l_t; the divisors of the aggregation stay.
    The statistics are token means over the mini-batch (``scale.num_tokens``); with a loss ``mask`` [T],
    over its tokens only (``aggregate``).
    """
    log_ratio = torch.clamp(logprobs - old_logprobs, -20.0, 20.0)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    per_token = torch.maximum(unclipped, clipped)
    capped = torch.zeros_like(per_token, dtype=torch.bool)
    if clip_ratio_c is not None:
        bound = -advantages * clip_ratio_c
        capped = (advantages < 0) & (per_token > bound)
        per_token = torch.where(advantages < 0, torch.minimum(per_token, bound), per_token)
    if is_weights is not None:
        per_token = per_token * is_weights.detach()
    tokens = max(scale.num_tokens, 1)
    with torch.no_grad():
        clipfrac = algos.masked((clipped > unclipped).float(), mask).sum() / tokens
        clipfrac_lower = algos.masked(capped.float(), mask).sum() / tokens
        approx_kl = algos.masked(-log_ratio, mask).sum() / tokens
    return PolicyLoss(loss=algos.aggregate(per_token, lengths, mode, scale=scale, mask=mask), clipfrac=clipfrac,
                      clipfrac_lower=clipfrac_lower,
                      approx_kl=approx_kl)



def token_share(per_token: torch.Tensor, inputs: PolicyLossInputs, params: PolicyLossParams) -> float:
    """Sum over the trained tokens / the mini-batch's trained tokens: this micro-batch's share of a token mean."""
    return float(algos.masked(per_token.detach().to(torch.float64), inputs.mask).sum()) / max(params.scale.num_tokens,
                                                                                              1)


def trained(inputs: PolicyLossInputs) -> torch.Tensor:
    """[T] bool: the tokens that train."""
    if inputs.mask is None:
        return torch.ones_like(inputs.logprobs, dtype=torch.bool)
    return inputs.mask.to(inputs.logprobs.device)


def weighted(per_token: torch.Tensor, inputs: PolicyLossInputs) -> torch.Tensor:
    """Each token's loss times its rollout-correction weight, where there are weights."""
    return per_token if inputs.is_weights is None else per_token * inputs.is_weights.detach()


def ppo_metrics(inputs: PolicyLossInputs, params: PolicyLossParams, clipped: torch.Tensor,
                *, clipped_lower: torch.Tensor | None, approx_kl: torch.Tensor) -> dict[str, float]:
    """verl's actor/pg_clipfrac, actor/pg_clipfrac_lower (0 where the loss has no lower clip) and actor/ppo_kl."""
    zero = torch.zeros_like(approx_kl)
    return {"actor/pg_clipfrac": token_share(clipped.to(approx_kl.dtype), inputs, params),
            "actor/pg_clipfrac_lower": token_share(zero if clipped_lower is None else clipped_lower.to(zero.dtype),
                                                   inputs, params),
            "actor/ppo_kl": token_share(approx_kl, inputs, params)}


def centred_covariance(inputs: PolicyLossInputs) -> torch.Tensor:
    """(A_t - mean A)(log pi_t - mean log pi), means over the trained tokens of the call, detached. [T]."""
    keep = trained(inputs)
    advantages, logprobs = inputs.advantages.detach(), inputs.logprobs.detach()
    count = max(int(keep.sum()), 1)
    mean_advantage = algos.masked(advantages, keep).sum() / count
    mean_logprob = algos.masked(logprobs, keep).sum() / count
    return (advantages - mean_advantage) * (logprobs - mean_logprob)


@register_policy_loss("vanilla", loss_agg_mode="token-mean")
def vanilla(inputs: PolicyLossInputs, params: PolicyLossParams) -> PolicyLossOutput:
    pg = policy_loss(
        logprobs=inputs.logprobs, old_logprobs=inputs.old_logprobs, advantages=inputs.advantages,
        lengths=inputs.lengths, clip_ratio_low=params.clip_ratio_low, clip_ratio_high=params.clip_ratio_high,
        clip_ratio_c=params.clip_ratio_c, mode=params.loss_agg_mode, scale=params.scale,
        is_weights=inputs.is_weights, mask=inputs.mask)
    return PolicyLossOutput(pg.loss, {"actor/pg_clipfrac": float(pg.clipfrac),
                                      "actor/pg_clipfrac_lower": float(pg.clipfrac_lower),
                                      "actor/ppo_kl": float(pg.approx_kl)})


@register_policy_loss("gspo", loss_agg_mode="seq-mean-token-mean")
def gspo(inputs: PolicyLossInputs, params: PolicyLossParams) -> PolicyLossOutput:
    logprobs, lengths = inputs.logprobs, inputs.lengths
    log_ratio = logprobs - inputs.old_logprobs
    counts = algos.sequence_sums(trained(inputs).to(log_ratio.dtype), lengths).clamp(min=1)
    sequence_log_ratio = algos.sequence_sums(algos.masked(log_ratio, inputs.mask), lengths) / counts
    log_s = logprobs - logprobs.detach() + algos.expand_per_token(sequence_log_ratio.detach(), lengths)
    ratio = torch.exp(torch.clamp(log_s, max=GSPO_LOG_RATIO_CAP))
    unclipped = -inputs.advantages * ratio
    clipped = -inputs.advantages * torch.clamp(ratio, 1.0 - params.clip_ratio_low, 1.0 + params.clip_ratio_high)
    per_token = weighted(torch.maximum(unclipped, clipped), inputs)
    loss = algos.aggregate(per_token, lengths, params.loss_agg_mode, scale=params.scale, mask=inputs.mask)
    return PolicyLossOutput(loss, ppo_metrics(inputs, params, clipped > unclipped, clipped_lower=None,
                                              approx_kl=-log_ratio.detach()))


@register_policy_loss("cispo", loss_agg_mode="token-mean")
def cispo(inputs: PolicyLossInputs, params: PolicyLossParams) -> PolicyLossOutput:
    log_ratio = torch.clamp(inputs.logprobs - inputs.old_logprobs, -20.0, 20.0)
    ratio = torch.exp(log_ratio).detach()
    weight = torch.clamp(ratio, 1.0 - params.clip_ratio_low, 1.0 + params.clip_ratio_high)
    per_token = weighted(-weight * inputs.advantages * inputs.logprobs, inputs)
    loss = algos.aggregate(per_token, inputs.lengths, params.loss_agg_mode, scale=params.scale, mask=inputs.mask)
    return PolicyLossOutput(loss, ppo_metrics(inputs, params, ratio != weight, clipped_lower=None,
                                              approx_kl=-log_ratio.detach()))


@register_policy_loss("geo_mean", loss_agg_mode="seq-mean-token-mean")
def geo_mean(inputs: PolicyLossInputs, params: PolicyLossParams) -> PolicyLossOutput:
    lengths, advantages = inputs.lengths, inputs.advantages
    log_ratio = inputs.logprobs - inputs.old_logprobs
    sign = torch.sign(advantages)
    bounded = torch.clamp(log_ratio, -params.clip_ratio_low, params.clip_ratio_high)
    clipped_log_ratio = sign * torch.minimum(sign * log_ratio, sign * bounded)
    counts = algos.sequence_sums(trained(inputs).to(log_ratio.dtype), lengths).clamp(min=1)  # all-masked: ratio 1
    ratio = torch.exp(algos.sequence_sums(algos.masked(clipped_log_ratio, inputs.mask), lengths) / counts)
    sequence_advantage = algos.sequence_sums(algos.masked(advantages, inputs.mask), lengths) / counts
    per_sequence = -sequence_advantage * ratio
    if inputs.is_weights is not None:
        log_weights = algos.masked(torch.log(inputs.is_weights.detach()), inputs.mask)  # a weight 0: the response 0
        per_sequence = per_sequence * torch.exp(algos.sequence_sums(log_weights, lengths) / counts)
    loss = per_sequence.sum() / max(params.scale.num_sequences, 1)
    out_of_range = log_ratio != bounded
    return PolicyLossOutput(loss, ppo_metrics(inputs, params, out_of_range & (advantages > 0),
                                              clipped_lower=out_of_range & (advantages < 0),
                                              approx_kl=-log_ratio.detach()))


@register_policy_loss("clip_cov", loss_agg_mode="token-mean")
def clip_cov(inputs: PolicyLossInputs, params: PolicyLossParams) -> PolicyLossOutput:
    advantages = inputs.advantages
    log_ratio = inputs.logprobs - inputs.old_logprobs
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - params.clip_ratio_low, 1.0 + params.clip_ratio_high)
    keep = trained(inputs)
    covariance = centred_covariance(inputs)
    candidates = torch.nonzero(keep & ~(clipped > unclipped) & (covariance > params.clip_cov_lb)
                               & (covariance < params.clip_cov_ub)).flatten()
    wanted = max(int(params.clip_cov_ratio * int(keep.sum())), 1)
    chosen = candidates[torch.randperm(len(candidates), device=candidates.device)[:wanted]]
    detached = torch.zeros_like(keep).index_fill_(0, chosen, True)
    per_token = weighted(torch.where(detached, torch.zeros_like(unclipped), torch.maximum(unclipped, clipped)),
                         inputs)
    loss = algos.aggregate(per_token, inputs.lengths, params.loss_agg_mode, scale=params.scale, mask=inputs.mask)
    return PolicyLossOutput(loss, ppo_metrics(inputs, params, detached, clipped_lower=None,
                                              approx_kl=-log_ratio.detach()))


@register_policy_loss("kl_cov", loss_agg_mode="token-mean")
def kl_cov(inputs: PolicyLossInputs, params: PolicyLossParams) -> PolicyLossOutput:
    advantages = inputs.advantages
    log_ratio = inputs.logprobs - inputs.old_logprobs
    surrogate = -advantages * torch.exp(log_ratio)
    keep = trained(inputs)
    positions = torch.nonzero(keep).flatten()
    penalised = torch.zeros_like(keep)
    if len(positions):
        wanted = max(int(len(positions) * params.kl_cov_ratio), 1)
        largest = torch.topk(centred_covariance(inputs)[positions], min(wanted, len(positions))).indices
        penalised[positions[largest]] = True
    per_token = torch.where(penalised, surrogate + params.ppo_kl_coef * log_ratio.abs(), surrogate)
    loss = algos.aggregate(weighted(per_token, inputs), inputs.lengths, params.loss_agg_mode, scale=params.scale,
                           mask=inputs.mask)
    return PolicyLossOutput(loss, ppo_metrics(inputs, params, torch.zeros_like(keep), clipped_lower=None,
                                              approx_kl=log_ratio.detach().abs()))


@register_policy_loss("gpg", loss_agg_mode="token-mean")
def gpg(inputs: PolicyLossInputs, params: PolicyLossParams) -> PolicyLossOutput:
    per_token = weighted(-inputs.advantages * inputs.logprobs, inputs)
    loss = algos.aggregate(per_token, inputs.lengths, params.loss_agg_mode, scale=params.scale, mask=inputs.mask)
    log_ratio = (inputs.logprobs - inputs.old_logprobs).detach()
    return PolicyLossOutput(loss, ppo_metrics(inputs, params, torch.zeros_like(log_ratio, dtype=torch.bool),
                                              clipped_lower=None,
                                              approx_kl=-log_ratio))
