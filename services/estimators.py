"""The built-in advantage estimators, registered by name as a user's are (``services/algo_registry.py``).

Choices, stated before the code:

- Each takes ``EstimatorInputs`` (token rewards [T], lengths [B], group ids [B], the loss mask, the critic's
  values, the greedy baselines) and ``EstimatorParams``, and returns ``algos.Advantages`` [T]: advantages,
  returns and metrics. The tokens outside the loss mask get advantage and return 0.
- Outcome estimators work on each response's score, the sum of its token rewards.
- gae, grpo, rloo, reinforce_plus_plus, reinforce_plus_plus_baseline: verl's definitions (below, each a pure
  function on tensors under its registered wrapper): GAE with whitened advantages and returns = advantages +
  values; GRPO = (score - group mean) / (group std + eps) (std unbiased) or without the division (Dr. GRPO);
  RLOO = score - mean of the other samples of the prompt; REINFORCE++ = whitened discounted returns;
  REINFORCE++-baseline = whitened (score - group mean). GRPO, RLOO and REINFORCE++-baseline return their
  advantages as returns (REINFORCE++ its discounted returns), as verl does. The others follow verl's
  core_algos.py and their papers:
  opo (Optimal-baseline Policy Optimization, arXiv:2505.23585): score minus the length-weighted mean score of
  the prompt's responses, sum(|y_j| r_j) / sum |y_j| (lengths counted in model tokens);
  gpg (Group Policy Gradient, arXiv:2504.02546): alpha (score - group mean) with alpha = B / (responses in the
  batch whose score is not 0), as verl computes it (verl's f_norm is 1). This is not the paper's correction:
  the paper's alpha is B / (B - M), M the responses of groups whose scores are all equal (no gradient), so
  the paper scales up by the responses that carry signal, verl by those that scored. They differ whenever a
  group with signal holds a 0 or a group without signal scored non-zero (scores 1, 0 | 1, 1 | 0, 0: verl 6/3,
  the paper 6/2); meshrl follows verl, as for every estimator;
  grpo_passk (Pass@k training, arXiv:2503.19595): only the best response of each group is credited, with
  (best score - second best) / (group std + 1e-6), or without the division when norm_adv_by_std_in_grpo is
  false; a tie for the best credits the first of them (which then gets 0);
  remax (arXiv:2310.10505): reward-to-go minus the score of the greedy response to the same prompt.
- A prompt with a single response has no baseline: grpo, rloo, reinforce_plus_plus_baseline, opo, gpg and
  grpo_passk give it advantage 0, a deliberate difference from verl (which passes its score through, and
  refuses grpo_passk).
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


# ---------------------------------------------------------------- the math of verl's original five


def padded_index(lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column of each flat token in right-padded [B, L] rows. [B] -> ([T], [T])."""
    rows = torch.repeat_interleave(torch.arange(len(lengths), device=lengths.device), lengths)
    starts = torch.cumsum(lengths, 0) - lengths
    return rows, torch.arange(len(rows), device=lengths.device) - starts[rows]


def to_padded(flat: torch.Tensor, lengths: torch.Tensor, index: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Flat [T] -> float64 right-padded [B, max length], 0 after each row's tokens."""
    width = int(lengths.max()) if len(lengths) else 0
    padded = torch.zeros(len(lengths), width, dtype=torch.float64, device=flat.device)
    padded[index] = flat.to(torch.float64)
    return padded


def group_stats(scores: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sequence group sum, count and unbiased std of the float64 scores."""
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    sums = torch.zeros(len(counts), dtype=torch.float64).index_add_(0, inverse, scores)
    means = sums / counts
    squares = torch.zeros(len(counts), dtype=torch.float64).index_add_(0, inverse, (scores - means[inverse]) ** 2)
    std = torch.sqrt(squares / (counts - 1).clamp(min=1))
    return sums[inverse], counts[inverse], std[inverse]


def gae_advantages(rewards: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor, *, gamma: float, lam: float,
                   mask: torch.Tensor | None = None) -> algos.Advantages:
    """Generalised advantage estimation, per sequence, then advantages whitened over the batch.

    rewards, values: [T]; delta_t = r_t + gamma V_{t+1} - V_t (V after the last token is 0),
    A_t = delta_t + gamma lam A_{t+1}; returns = A + V (before whitening). The recursion runs in
    float64 on right-padded [B, L] rows, all rows at once; zero padding keeps it inside each row.

    With a loss ``mask`` [T] (multi-turn: False on tool and environment tokens) the recursion passes
    over the masked tokens as if they were not there, verl's convention for its multi-turn
    response_mask: V_{t+1} is the value of the next model token and A_{t+1} its advantage, so the
    discount counts model tokens only; whitening is over model tokens, and masked tokens get
    advantage and return 0 (they train nothing).
    """
    index = padded_index(lengths.to(rewards.device))
    padded_rewards = to_padded(rewards, lengths, index)
    padded_values = to_padded(values, lengths, index)
    trained = to_padded(torch.ones_like(rewards) if mask is None else mask.to(rewards.device), lengths, index) > 0
    padded = torch.zeros_like(padded_rewards)
    running = torch.zeros(len(lengths), dtype=torch.float64, device=rewards.device)
    next_value = torch.zeros_like(running)
    for t in range(padded.shape[1] - 1, -1, -1):
        delta = padded_rewards[:, t] + gamma * next_value - padded_values[:, t]
        running = torch.where(trained[:, t], delta + gamma * lam * running, running)
        padded[:, t] = running
        next_value = torch.where(trained[:, t], padded_values[:, t], next_value)
    advantages = padded[index].float()
    returns = algos.masked(advantages + values.float(), mask)
    return algos.Advantages(algos.whiten(advantages, mask), returns)


def grpo_advantages(scores: torch.Tensor, group_ids: torch.Tensor, norm_by_std: bool = True,
                    *, eps: float = 1e-6) -> torch.Tensor:
    """Group-normalised advantage of each sequence (GRPO). [B], [B] -> [B].

    (score - group mean) / (group std + eps), or without the division when
    ``norm_by_std`` is False (Dr. GRPO). Groups of one get 0.
    """
    scores = scores.to(torch.float64)
    sums, counts, std = group_stats(scores, group_ids)
    centred = scores - sums / counts
    advantages = centred / (std + eps) if norm_by_std else centred
    return torch.where(counts > 1, advantages, torch.zeros_like(advantages)).to(torch.float32)


def rloo_advantages(scores: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """REINFORCE leave-one-out: score minus the mean of the prompt's other samples. [B], [B] -> [B]."""
    scores = scores.to(torch.float64)
    sums, counts, _ = group_stats(scores, group_ids)
    others = (sums - scores) / (counts - 1).clamp(min=1)
    return torch.where(counts > 1, scores - others, torch.zeros_like(scores)).to(torch.float32)


def discounted_returns(rewards: torch.Tensor, lengths: torch.Tensor, gamma: float,
                       *, mask: torch.Tensor | None = None) -> torch.Tensor:
    """G_t = r_t + gamma G_{t+1} within each sequence, in float64 on padded rows (see ``gae``). [T], [B] -> [T].

    With a loss ``mask`` [T], G_{t+1} is the next model token's and masked tokens get 0 (as ``gae``)."""
    index = padded_index(lengths.to(rewards.device))
    padded_rewards = to_padded(rewards, lengths, index)
    trained = to_padded(torch.ones_like(rewards) if mask is None else mask.to(rewards.device), lengths, index) > 0
    padded = torch.zeros_like(padded_rewards)
    running = torch.zeros(len(lengths), dtype=torch.float64, device=rewards.device)
    for t in range(padded.shape[1] - 1, -1, -1):
        running = torch.where(trained[:, t], padded_rewards[:, t] + gamma * running, running)
        padded[:, t] = running
    return algos.masked(padded[index].float(), mask)


def reinforce_plus_plus_advantages(rewards: torch.Tensor, lengths: torch.Tensor, gamma: float,
                                   *, mask: torch.Tensor | None = None) -> algos.Advantages:
    """REINFORCE++: discounted returns, whitened over the batch (its model tokens), are the advantages.
    [T] -> [T]."""
    returns = discounted_returns(rewards, lengths, gamma, mask=mask)
    return algos.Advantages(algos.whiten(returns, mask), returns)


def reinforce_plus_plus_baseline_advantages(scores: torch.Tensor, group_ids: torch.Tensor, lengths: torch.Tensor,
                                            *, mask: torch.Tensor | None = None) -> algos.Advantages:
    """REINFORCE++ with the group mean as baseline, on every token, whitened over the batch. [B] -> [T].

    The returns are the whitened advantages too, as verl returns them (``(scores, scores)``). With a loss
    ``mask`` [T], on and over its tokens only (0 on the others).
    """
    scores = scores.to(torch.float64)
    sums, counts, _ = group_stats(scores, group_ids)
    centred = torch.where(counts > 1, scores - sums / counts, torch.zeros_like(scores)).to(torch.float32)
    advantages = algos.whiten(algos.expand_per_token(centred, lengths), mask)
    return algos.Advantages(advantages, advantages)



# ---------------------------------------------------------------- verl's original five, registered


@register_adv_est("gae")
def gae(inputs: EstimatorInputs, params: EstimatorParams) -> algos.Advantages:
    if inputs.values is None:
        raise ValueError("the gae estimator needs values from a critic")
    return gae_advantages(inputs.rewards, inputs.values, inputs.lengths, gamma=params.gamma, lam=params.lam,
                          mask=inputs.mask)


@register_adv_est("grpo")
def grpo(inputs: EstimatorInputs, params: EstimatorParams) -> algos.Advantages:
    return per_response(grpo_advantages(scores_of(inputs), inputs.group_ids, params.norm_by_std), inputs)


@register_adv_est("rloo")
def rloo(inputs: EstimatorInputs, params: EstimatorParams) -> algos.Advantages:
    return per_response(rloo_advantages(scores_of(inputs), inputs.group_ids), inputs)


@register_adv_est("reinforce_plus_plus")
def reinforce_plus_plus(inputs: EstimatorInputs, params: EstimatorParams) -> algos.Advantages:
    return reinforce_plus_plus_advantages(inputs.rewards, inputs.lengths, params.gamma, mask=inputs.mask)


@register_adv_est("reinforce_plus_plus_baseline")
def reinforce_plus_plus_baseline(inputs: EstimatorInputs, params: EstimatorParams) -> algos.Advantages:
    return reinforce_plus_plus_baseline_advantages(scores_of(inputs), inputs.group_ids, inputs.lengths,
                                                   mask=inputs.mask)


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
    """alpha (score - group mean), alpha = B / (responses of the batch scoring non-zero, at least 1): verl's
    alpha, not the paper's B / (B - responses of groups without signal) (the module's docstring says where they
    differ)."""
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
