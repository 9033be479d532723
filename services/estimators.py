"""The built-in advantage estimators, registered by name as a user's are (``services/algo_registry.py``).

Choices, stated before the code:

- Each takes ``EstimatorInputs`` (token rewards [T], lengths [B], group ids [B], the loss mask, the critic's
  values, the greedy baselines) and ``EstimatorParams``, and returns ``algos.Advantages`` [T]: advantages,
  returns and metrics. The tokens outside the loss mask get advantage and return 0.
- Outcome estimators work on each response's score, the sum of its token rewards.
- gae, grpo, rloo, reinforce_plus_plus, reinforce_plus_plus_baseline: ``services/algos.py`` (verl's
  definitions). The others follow verl's core_algos.py and their papers:
  opo (Optimal-baseline Policy Optimization, arXiv:2505.23585): score minus the length-weighted mean score of
  the prompt's responses, sum(|y_j| r_j) / sum |y_j| (lengths counted in model tokens);
  gpg (Group Policy Gradient, arXiv:2504.02546): alpha (score - group mean) with alpha = B / (responses in the
  batch whose score is not 0), the paper's correction for groups without signal (verl's f_norm is 1);
  grpo_passk (Pass@k training, arXiv:2503.19595): only the best response of each group is credited, with
  (best score - second best) / (group std + 1e-6), or without the division when norm_adv_by_std_in_grpo is
  false; a tie for the best credits the first of them (which then gets 0);
  remax (arXiv:2310.10505): reward-to-go minus the score of the greedy response to the same prompt.
- As for grpo and rloo here, a prompt with a single response has no baseline: opo, gpg and grpo_passk give it
  advantage 0 (verl passes opo's and gpg's score through and refuses grpo_passk).
- Like grpo and rloo, opo, gpg and grpo_passk return their advantages as returns; remax returns the
  reward-to-go, as verl does.
"""

from __future__ import annotations

import torch

from services import algos
from services.algo_registry import ADV_ESTIMATORS, EstimatorInputs, EstimatorParams, register_adv_est

GRPO_EPS = 1e-6


def scores_of(inputs: EstimatorInputs) -> torch.Tensor:
    """Each response's score, the sum of its token rewards, in float64. [B]."""
    return algos.sequence_sums(inputs.rewards.to(torch.float64), inputs.lengths)


def per_response(advantages: torch.Tensor, inputs: EstimatorInputs) -> algos.Advantages:
    """Per-response advantages [B] on each of its model tokens, as both advantages and returns [T], in the dtype
    of the rewards."""
    per_token = algos.masked(algos.expand_per_token(advantages.to(inputs.rewards.dtype), inputs.lengths), inputs.mask)
    return algos.Advantages(per_token, per_token)


def trained_lengths(inputs: EstimatorInputs) -> torch.Tensor:
    """Model tokens of each response: its length, or its tokens in the loss mask. [B] int64."""
    if inputs.mask is None:
        return inputs.lengths.to(torch.int64)
    return algos.sequence_sums(inputs.mask.to(torch.int64), inputs.lengths)


def group_index(group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each response's group as 0..G-1, and each response's group size. [B] -> ([B], [B])."""
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    return inverse, counts[inverse]


def group_sums(values: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """The sum over each response's group, per response. [B], [B] -> [B]."""
    groups = int(inverse.max()) + 1 if len(inverse) else 0
    return torch.zeros(groups, dtype=values.dtype).index_add_(0, inverse, values)[inverse]


# ---------------------------------------------------------------- verl's original five (math in algos.py)


@register_adv_est("gae")
def gae(inputs: EstimatorInputs, params: EstimatorParams) -> algos.Advantages:
    if inputs.values is None:
        raise ValueError("the gae estimator needs values from a critic")
    return algos.gae(inputs.rewards, inputs.values, inputs.lengths, params.gamma, params.lam, inputs.mask)


@register_adv_est("grpo")
def grpo(inputs: EstimatorInputs, params: EstimatorParams) -> algos.Advantages:
    return per_response(algos.grpo_advantages(scores_of(inputs), inputs.group_ids, params.norm_by_std), inputs)


@register_adv_est("rloo")
def rloo(inputs: EstimatorInputs, params: EstimatorParams) -> algos.Advantages:
    return per_response(algos.rloo_advantages(scores_of(inputs), inputs.group_ids), inputs)


@register_adv_est("reinforce_plus_plus")
def reinforce_plus_plus(inputs: EstimatorInputs, params: EstimatorParams) -> algos.Advantages:
    return algos.reinforce_plus_plus(inputs.rewards, inputs.lengths, params.gamma, inputs.mask)


@register_adv_est("reinforce_plus_plus_baseline")
def reinforce_plus_plus_baseline(inputs: EstimatorInputs, params: EstimatorParams) -> algos.Advantages:
    return algos.reinforce_plus_plus_baseline(scores_of(inputs), inputs.group_ids, inputs.lengths, inputs.mask)


# ---------------------------------------------------------------- opo, gpg, grpo_passk, remax


@register_adv_est("opo")
def opo(inputs: EstimatorInputs, params: EstimatorParams) -> algos.Advantages:
    """score - sum(|y_j| r_j) / sum |y_j| over the prompt's responses j (0 for a group of one)."""
    scores = scores_of(inputs)
    lengths = trained_lengths(inputs).to(torch.float64)
    inverse, sizes = group_index(inputs.group_ids)
    baseline = group_sums(lengths * scores, inverse) / group_sums(lengths, inverse).clamp(min=1)
    return per_response(torch.where(sizes > 1, scores - baseline, torch.zeros_like(scores)), inputs)


@register_adv_est("gpg")
def gpg(inputs: EstimatorInputs, params: EstimatorParams) -> algos.Advantages:
    """alpha (score - group mean), alpha = B / (responses of the batch scoring non-zero), at least 1 of them."""
    scores = scores_of(inputs)
    inverse, sizes = group_index(inputs.group_ids)
    alpha = len(scores) / max(int(torch.count_nonzero(scores)), 1)
    centred = scores - group_sums(scores, inverse) / sizes
    advantages = torch.where(sizes > 1, alpha * centred, torch.zeros_like(scores))
    return per_response(advantages, inputs)


@register_adv_est("grpo_passk")
def grpo_passk(inputs: EstimatorInputs, params: EstimatorParams) -> algos.Advantages:
    """The best response of each group gets (best - second best) [/ (group std + 1e-6)]; the others 0."""
    scores = scores_of(inputs)
    inverse, _ = group_index(inputs.group_ids)
    advantages = torch.zeros_like(scores)
    for group in range(int(inverse.max()) + 1 if len(inverse) else 0):
        members = torch.nonzero(inverse == group).flatten()
        if len(members) < 2:
            continue
        ranked = torch.sort(scores[members], descending=True, stable=True)
        gap = ranked.values[0] - ranked.values[1]
        if params.norm_by_std:
            gap = gap / (scores[members].std(unbiased=True) + GRPO_EPS)
        advantages[members[ranked.indices[0]]] = gap
    return per_response(advantages, inputs)


def reward_to_go(rewards: torch.Tensor, lengths: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Undiscounted sum of each token's model-token rewards from it to its response's end, in the rewards' dtype;
    0 off the mask. [T], [B] -> [T]."""
    taken = algos.masked(rewards, mask)
    running = torch.cumsum(taken, 0)
    ends = algos.expand_per_token(running[torch.cumsum(lengths, 0) - 1] if len(running) else running, lengths)
    return algos.masked(ends - running + taken, mask)


@register_adv_est("remax", greedy_baseline=True)
def remax(inputs: EstimatorInputs, params: EstimatorParams) -> algos.Advantages:
    """Advantages: reward-to-go (undiscounted) minus the greedy response's score, on every model token; returns:
    the reward-to-go."""
    if inputs.baselines is None:
        raise ValueError("the remax estimator needs the greedy responses' scores (baselines)")
    returns = reward_to_go(inputs.rewards, inputs.lengths, inputs.mask)
    baseline = algos.expand_per_token(inputs.baselines.to(returns.dtype), inputs.lengths)
    return algos.Advantages(algos.masked(returns - baseline, inputs.mask), returns)


def compute_advantages(name: str, inputs: EstimatorInputs, params: EstimatorParams) -> algos.Advantages:
    """The advantages [T] of the estimator registered as ``name`` (ValueError listing those registered)."""
    return ADV_ESTIMATORS.get(name).fn(inputs, params)
