"""RL math for meshrl: pure functions on tensors, the pieces the estimators and the losses share.

Choices, stated before the code:

- Sequences travel padding-free: a batch of B responses is one flat tensor of
  all response tokens plus ``lengths`` [B]. Token-level tensors here are flat
  ``[T]`` with ``T = lengths.sum()``; per-sequence tensors are ``[B]``.
- Rewards are outcome rewards: a response's score sits on its last token
  (``token_rewards``), minus ``kl_coef * kl`` on every token when the KL
  penalty goes into the reward.
- The advantage estimators are in ``services/estimators.py``, the policy losses in
  ``services/policy_losses.py``; this module holds what both stand on and the value loss, rollout correction,
  KL, optimisation schedule and metrics.
- Whitening is over all response tokens of the batch: (x - mean) /
  sqrt(unbiased var + 1e-8).
- Losses are aggregated by ``aggregate`` in verl's four modes. Every divisor
  comes from a ``LossScale`` that describes the whole mini-batch, so the
  losses of its micro-batches add up to the mini-batch loss, and their
  gradients to its gradient.
- Rollout correction (verl's rollout_correction, TRL's
  vllm_importance_sampling_correction): the rollout engine's policy differs
  from the trainer's (kernels, precision, stale weights), so each token's
  policy-gradient loss is multiplied by a detached importance weight
  pi_old / pi_rollout. At sequence level the weight is the product of the
  response's token ratios, exp(sum of log-ratios), as both verl and TRL do
  (not the geometric mean, which verl keeps for rejection sampling); the
  log-ratio is clamped to +-20 first, as verl does, so exp stays finite.
  Above the threshold a weight is truncated to it (TIS) or set to 0 (masked
  IS, TRL's *_mask); only the upper side is bounded.
- A loss mask [T] bool (``SequenceBatch.loss_mask``: False on the tool and
  environment tokens inside a multi-turn response) is the one place the
  trainer's tokens are chosen: the losses take it as ``mask``, and a masked
  token has no policy-gradient, entropy, KL or value loss, no rollout
  correction weight, and counts in no divisor (``LossScale.of``, the
  per-sequence means of ``aggregate``) nor statistic. Without it every
  response token trains. The advantages see the same mask
  (``compute_advantages``): a response's score sits on its last model token,
  GAE and discounted returns pass over tool tokens as verl's GAE does with
  its multi-turn response_mask, whitening counts model tokens only, and tool
  tokens get advantage and return 0.

No config objects, no I/O: everything arrives as plain arguments.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import NamedTuple

import torch

from services.algo_names import KL_ESTIMATORS, LOSS_AGG_MODES, ROLLOUT_IS_LEVELS, ROLLOUT_IS_MODES

WHITEN_EPS = 1e-8


# ---------------------------------------------------------------- helpers


def expand_per_token(per_sequence: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Repeat a per-sequence value over that sequence's tokens. [B], [B] -> [T]."""
    return torch.repeat_interleave(per_sequence, lengths)


def sequence_sums(per_token: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Sum of each sequence's tokens. [T], [B] -> [B]."""
    index = torch.repeat_interleave(torch.arange(len(lengths), device=per_token.device), lengths.to(per_token.device))
    return torch.zeros(len(lengths), dtype=per_token.dtype, device=per_token.device).index_add_(0, index, per_token)


def last_token_index(lengths: torch.Tensor) -> torch.Tensor:
    """Flat index of each sequence's last token (sequences of length 0 are not listed). [B] -> [B']."""
    ends = torch.cumsum(lengths, 0) - 1
    return ends[lengths > 0]


def masked(per_token: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """``per_token`` [T] with 0 (and a zero gradient, even from inf or NaN) where ``mask`` [T] is False."""
    if mask is None:
        return per_token
    return torch.where(mask.to(per_token.device), per_token, torch.zeros_like(per_token))


def whiten(values: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """(x - mean) / sqrt(unbiased var + 1e-8) over all tokens, or over the tokens of a loss ``mask`` (the others
    become 0). [T] -> [T]."""
    if mask is not None:
        return torch.zeros_like(values).masked_scatter(mask, whiten(values[mask]))
    if values.numel() < 2:
        return values - values.mean() if values.numel() else values
    mean = values.mean()
    var = values.var(unbiased=True)
    return (values - mean) * torch.rsqrt(var + WHITEN_EPS)


# ---------------------------------------------------------------- rewards and KL


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token KL estimate of the policy from the reference. [T], [T] -> [T].

    kl/k1: logp - ref; abs: |logp - ref|; mse/k2: 0.5 (logp - ref)^2;
    low_var_kl/k3: exp(ref - logp) - (ref - logp) - 1, clamped to [-10, 10].
    """
    if estimator in ("kl", "k1"):
        return logprobs - ref_logprobs
    if estimator == "abs":
        return (logprobs - ref_logprobs).abs()
    if estimator in ("mse", "k2"):
        return 0.5 * (logprobs - ref_logprobs).square()
    if estimator in ("low_var_kl", "k3"):
        log_ratio = torch.clamp(ref_logprobs - logprobs, -20, 20)
        return torch.clamp(torch.exp(log_ratio) - log_ratio - 1, -10, 10)
    raise ValueError(f"unknown KL estimator {estimator!r}; expected one of {KL_ESTIMATORS}")


def last_trained_index(lengths: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Flat index of each non-empty sequence's last token in the loss ``mask`` (its last token where it has
    none). [B], [T] -> [B']."""
    rows = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    positions = torch.where(mask, torch.arange(len(mask)), torch.full_like(rows, -1))
    last = torch.full((len(lengths),), -1, dtype=torch.int64).scatter_reduce(0, rows, positions, "amax")
    ends = torch.cumsum(lengths, 0) - 1
    return torch.where(last >= 0, last, ends)[lengths > 0]


def token_rewards(scores: torch.Tensor, lengths: torch.Tensor, kl: torch.Tensor | None = None,
                  *, kl_coef: float = 0.0, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Score on each response's last token, minus kl_coef * kl on every token. [B], [B], [T] -> [T].

    With a loss ``mask`` [T]: on each response's last model token (``last_trained_index``), the KL penalty on
    model tokens only."""
    rewards = torch.zeros(int(lengths.sum()), dtype=torch.float32)
    last = last_token_index(lengths) if mask is None else last_trained_index(lengths, mask)
    rewards[last] = scores[lengths > 0].float()
    if kl is not None:
        rewards = rewards - kl_coef * masked(kl.float(), mask)
    return rewards


def adaptive_kl_coef(coef: float, current_kl: float, n_steps: int, *, target: float, horizon: int) -> float:
    """The adaptive KL controller's next coefficient (Ziegler et al.): proportional error clipped to +-0.2."""
    error = min(max(current_kl / target - 1.0, -0.2), 0.2)
    return coef * (1.0 + error * n_steps / horizon)


# ---------------------------------------------------------------- what an estimator returns (the estimators:
# services/estimators.py)


class Advantages(NamedTuple):
    advantages: torch.Tensor  # [T]
    returns: torch.Tensor  # [T]
    metrics: Mapping[str, float] = MappingProxyType({})  # what the estimator reports besides (verl's names)


# ---------------------------------------------------------------- loss aggregation (the policy losses:
# services/policy_losses.py; the value loss below)


class LossScale(NamedTuple):
    """The divisors of a mini-batch's loss, so that micro-batch losses add up to it."""

    num_tokens: int  # response tokens in the mini-batch (token-mean)
    num_sequences: int  # sequences in the mini-batch (seq-mean-*)
    max_response_length: int  # the constant divisor of seq-mean-token-sum-norm (Dr. GRPO), besides the sequences

    @classmethod
    def of(cls, lengths: torch.Tensor, max_response_length: int, mask: torch.Tensor | None = None) -> LossScale:
        """The scale of a mini-batch of responses with ``lengths`` [B] and, where some tokens do not train, the
        loss ``mask`` [T] of their tokens (its trained tokens are the mini-batch's tokens)."""
        tokens = int(lengths.sum()) if mask is None else int(mask.sum())
        return cls(tokens, len(lengths), max_response_length)


def aggregate(per_token: torch.Tensor, lengths: torch.Tensor, mode: str, *, scale: LossScale,
              mask: torch.Tensor | None = None) -> torch.Tensor:
    """Reduce per-token losses [T] of sequences with ``lengths`` [B] to a scalar, verl's way.

    token-mean: sum / tokens; seq-mean-token-sum: sum of sequence sums / sequences;
    seq-mean-token-mean: sum of sequence means / sequences;
    seq-mean-token-sum-norm (Dr. GRPO): sum of sequence sums / sequences / max_response_length, as verl >= 0.7.1
    (its PR #5417 added the division by sequences; verl <= 0.7.0 divided by max_response_length only).
    With a loss ``mask`` [T] only its tokens are summed, and a sequence's mean is over its trained tokens.
    """
    per_token = masked(per_token, mask)
    if mode == "token-mean":
        return per_token.sum() / max(scale.num_tokens, 1)
    sums = sequence_sums(per_token, lengths)
    if mode == "seq-mean-token-sum":
        return sums.sum() / max(scale.num_sequences, 1)
    if mode == "seq-mean-token-mean":
        counts = lengths.to(sums.device) if mask is None else sequence_sums(mask.to(sums.device).long(), lengths)
        return (sums / counts.clamp(min=1)).sum() / max(scale.num_sequences, 1)
    if mode == "seq-mean-token-sum-norm":
        return sums.sum() / max(scale.num_sequences, 1) / scale.max_response_length
    raise ValueError(f"unknown loss_agg_mode {mode!r}; expected one of {LOSS_AGG_MODES}")


# ---------------------------------------------------------------- rollout correction


def rollout_log_ratio(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, lengths: torch.Tensor,
                      *, level: str, mask: torch.Tensor | None = None) -> torch.Tensor:
    """log(pi_old / pi_rollout), detached and clamped to +-20. [T], [T], [B] -> [T] (token) or [B] (sequence).

    token: old_logp_t - rollout_logp_t (0 where the loss ``mask`` is False); sequence: the sum of those over
    each response (0 for an empty one), so over its trained tokens only.
    """
    per_token = masked((old_logprobs - rollout_logprobs).detach(), mask)
    if level == "token":
        return per_token.clamp(-20.0, 20.0)
    if level == "sequence":
        return sequence_sums(per_token, lengths).clamp(-20.0, 20.0)
    raise ValueError(f"unknown rollout_is level {level!r}; expected one of {ROLLOUT_IS_LEVELS}")


class RolloutISWeights(NamedTuple):
    weights: torch.Tensor  # [T], detached: the factor on each token's policy-gradient loss
    exceeded: torch.Tensor  # [T] bool: the token's (sequence level: its response's) ratio was above the threshold


def rollout_is_weights(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, lengths: torch.Tensor,
                       *, level: str, mode: str, threshold: float,
                       mask: torch.Tensor | None = None) -> RolloutISWeights:
    """Importance weights pi_old / pi_rollout of the rollout/trainer mismatch. [T], [T], [B] -> [T].

    token: rho_t = exp(old_logp_t - rollout_logp_t); sequence: every token of a response gets
    exp(sum of its log-ratios). Ratios above ``threshold`` are truncated to it (mode truncate, TIS)
    or set to 0 (mode mask). Where the loss ``mask`` [T] is False a token has weight 0 and never exceeds,
    and a response's sequence ratio is over its trained tokens only.
    """
    if mode not in ROLLOUT_IS_MODES:
        raise ValueError(f"unknown rollout_is mode {mode!r}; expected one of {ROLLOUT_IS_MODES}")
    ratio = torch.exp(rollout_log_ratio(old_logprobs, rollout_logprobs, lengths, level=level, mask=mask))
    if level == "sequence":
        ratio = expand_per_token(ratio, lengths.to(ratio.device))
    exceeded = ratio > threshold
    if mask is not None:
        exceeded = exceeded & mask.to(ratio.device)
    if mode == "truncate":
        weights = ratio.clamp(max=threshold)
    else:
        weights = torch.where(exceeded, torch.zeros_like(ratio), ratio)
    return RolloutISWeights(masked(weights, mask), exceeded)


class ValueLoss(NamedTuple):
    loss: torch.Tensor  # scalar: 0.5 * aggregated clipped squared error
    clipfrac: torch.Tensor  # share of tokens where the clipped error was the larger (critic/vf_clipfrac)


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, *, lengths: torch.Tensor,
               cliprange_value: float, mode: str, scale: LossScale, mask: torch.Tensor | None = None) -> ValueLoss:
    """Clipped value loss: 0.5 * agg(max((V - R)^2, (clip(V, V_old +- c) - R)^2)). Token tensors [T]; with a
    loss ``mask`` [T], over its tokens only."""
    clipped_values = torch.clamp(values, old_values - cliprange_value, old_values + cliprange_value)
    unclipped_error = (values - returns).square()
    clipped_error = (clipped_values - returns).square()
    per_token = torch.maximum(unclipped_error, clipped_error)
    with torch.no_grad():
        clipfrac = masked((clipped_error > unclipped_error).float(), mask).sum() / max(scale.num_tokens, 1)
    return ValueLoss(0.5 * aggregate(per_token, lengths, mode, scale=scale, mask=mask), clipfrac)


def explained_variance(returns: torch.Tensor, values: torch.Tensor) -> float:
    """1 - Var(returns - values) / Var(returns), over all tokens (unbiased variances)."""
    if returns.numel() < 2:
        return 0.0
    return float(1.0 - (returns - values).var() / (returns.var() + WHITEN_EPS))


# ---------------------------------------------------------------- per-token model outputs


def upcast(logits: torch.Tensor) -> torch.Tensor:
    """Logits in fp32, or in their own dtype where it is wider (float64 stays float64)."""
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-probability of each token under temperature-scaled logits, in fp32 (or wider). [..., V], [...] -> [...]."""
    scaled = upcast(logits) / temperature
    return torch.log_softmax(scaled, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


class LogprobDiff(NamedTuple):
    """How far two sets of logprobs of the same tokens are apart."""

    mean: float  # mean |a - b| over the tokens
    max: float  # largest |a - b|


def logprob_diff(a: torch.Tensor, b: torch.Tensor) -> LogprobDiff:
    """Mean and max |a - b| over the tokens (the weight check: a rollout's probe logprobs against the trainer's).
    A non-finite logprob on either side counts as infinitely far; no tokens are 0 apart. [T], [T] -> scalars."""
    if a.shape != b.shape:
        raise ValueError(f"logprobs of {tuple(a.shape)} and {tuple(b.shape)} tokens: they must be of the same tokens")
    if not a.numel():
        return LogprobDiff(0.0, 0.0)
    apart = (a.double() - b.double()).abs()
    apart = torch.where(torch.isfinite(a) & torch.isfinite(b), apart, torch.full_like(apart, math.inf))
    return LogprobDiff(mean=float(apart.mean()), max=float(apart.max()))


TAIL_FLOOR = 1e-30  # the least probability a tail bucket is given inside a log (its mass may round to 0)


def topk_kl(p_top: torch.Tensor, q_at_p_top: torch.Tensor) -> torch.Tensor:
    """KL(p || q) at each position over the partition of the vocabulary into p's k most likely tokens, each its own
    bucket, and the rest of the vocabulary as one (the tail): sum_i p_i log(p_i / q_i) + p_tail log(p_tail /
    q_tail), with p_tail = 1 - sum_i p_i and q_tail = 1 - sum_i q_i (the weight check's probe: p the rollout's
    next-token distribution, q the trainer's at the rollout's top-k ids).

    Both distributions coarsened by the same partition, so it is 0 where they agree on every bucket and never more
    than their KL over the whole vocabulary (the data processing inequality); a q that puts little mass on p's
    top-k shows it, whichever tokens q ranks first. A tail that rounds to 0 counts as ``TAIL_FLOOR`` inside the
    log; a token of p's top-k with probability 0 (a vocabulary smaller than k) adds nothing. [T, k] logprobs,
    [T, k] logprobs of the same ids -> [T] float64."""
    if p_top.shape != q_at_p_top.shape:
        raise ValueError(f"top-k logprobs of shape {tuple(p_top.shape)} and {tuple(q_at_p_top.shape)}: they must be "
                         "of the same tokens")
    p_log, q_log = p_top.double(), q_at_p_top.double()
    p, q = p_log.exp(), q_log.exp()
    head = torch.where(p > 0, p * (p_log - q_log), torch.zeros_like(p)).sum(dim=-1)
    p_tail = (1 - p.sum(dim=-1)).clamp(min=0)
    q_tail = (1 - q.sum(dim=-1)).clamp(min=0)
    tail = p_tail * (p_tail.clamp(min=TAIL_FLOOR).log() - q_tail.clamp(min=TAIL_FLOOR).log())
    return head + tail


class DistributionDiff(NamedTuple):
    """How far two sets of next-token distributions at the same positions are apart (``topk_kl``)."""

    mean: float  # mean KL over the positions
    max: float  # largest KL at one position


def distribution_diff(kl: torch.Tensor) -> DistributionDiff:
    """Mean and max of per-position KLs (``topk_kl``); a non-finite one counts as infinite; no positions: 0.
    [T] -> scalars."""
    if not kl.numel():
        return DistributionDiff(0.0, 0.0)
    kl = torch.where(torch.isfinite(kl), kl.double(), torch.full_like(kl, math.inf, dtype=torch.float64))
    return DistributionDiff(mean=float(kl.mean()), max=float(kl.max()))


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of the temperature-scaled distribution at each position. [..., V] -> [...]."""
    log_probs = torch.log_softmax(upcast(logits) / temperature, dim=-1)
    return -(log_probs.exp() * log_probs).sum(-1)


def sequence_nll(logprobs: torch.Tensor, num_tokens: int | None = None,
                 mask: torch.Tensor | None = None) -> torch.Tensor:
    """Supervised loss: mean negative log-likelihood of the target tokens. [T] -> scalar.

    ``mask`` ([T] bool): only its tokens are targets (a tool's reply inside a multi-turn response is not); the
    divisor is ``num_tokens`` (the whole batch's targets, when this is one micro-batch of it), else their count.
    """
    if mask is not None:
        logprobs = torch.where(mask, logprobs, torch.zeros_like(logprobs))
    divisor = num_tokens if num_tokens is not None else (logprobs.numel() if mask is None else int(mask.sum()))
    return -logprobs.sum() / max(divisor, 1)


# ---------------------------------------------------------------- optimisation


def lr_factor(step: int, warmup_steps: int, total_steps: int, *, style: str, min_lr_ratio: float) -> float:
    """Multiplier of the peak learning rate after ``step`` scheduler steps (0-based).

    Linear warmup over ``warmup_steps`` = W, then constant, or a cosine decay to
    ``min_lr_ratio`` at ``total_steps``. The schedule advances once per update
    call, so update k (1-based: every optimizer step of the k-th training step)
    runs at lr * k / W for k <= W: lr / W first, the full lr at update W.

    This differs from verl by one update: verl's warm-up factor is by default
    step / max(1, W) from step 0, so its update k runs at lr * (k - 1) / W: the
    first at lr 0, the full lr only at update W + 1 (and W = 1 is one update at
    lr 0 there, no warm-up at all here). Deliberately: an update at lr 0 leaves
    the weights as they were, so a whole RL step (generation, scoring, logprobs,
    forward and backward) is spent for nothing but AdamW's moment estimates.
    """
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    if style == "constant":
        return 1.0
    if style == "cosine":
        span = max(total_steps - warmup_steps, 1)
        progress = min(max(step - warmup_steps, 0) / span, 1.0)
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown lr schedule {style!r}; expected constant or cosine")


def groups_with_signal(scores: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """DAPO dynamic sampling: True for sequences whose group's scores are not all equal. [B] -> [B] bool."""
    _, inverse = torch.unique(group_ids, return_inverse=True)
    groups = int(inverse.max()) + 1 if len(inverse) else 0
    high = torch.full((groups,), -math.inf, dtype=torch.float64).scatter_reduce(0, inverse, scores.double(), "amax")
    low = torch.full((groups,), math.inf, dtype=torch.float64).scatter_reduce(0, inverse, scores.double(), "amin")
    return (high > low)[inverse]


def mean_sequence_kl(kl: torch.Tensor, lengths: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    """Batch mean of each sequence's token-mean KL (the adaptive controller's measurement); with a loss ``mask``,
    each sequence's mean over its model tokens."""
    if len(lengths) == 0:
        return 0.0
    counts = lengths if mask is None else sequence_sums(mask.long(), lengths)
    return float((sequence_sums(masked(kl, mask), lengths) / counts.clamp(min=1)).mean())


# ---------------------------------------------------------------- metrics of the rollout/trainer mismatch
# (here rather than with the coordinator's step metrics: the trainer computes them too, from its update's own
# logprobs, when a step has no old-logprob pass)


def summary(prefix: str, values: torch.Tensor) -> dict[str, float]:
    """{prefix}/mean, /max, /min of a tensor (zeros when it is empty)."""
    if values.numel() == 0:
        return {f"{prefix}/mean": 0.0, f"{prefix}/max": 0.0, f"{prefix}/min": 0.0}
    values = values.float()
    return {f"{prefix}/mean": float(values.mean()), f"{prefix}/max": float(values.max()),
            f"{prefix}/min": float(values.min())}


def pearson(x: torch.Tensor, y: torch.Tensor) -> float:
    """Pearson correlation of two equally long tensors; 0 where it is undefined (fewer than 2 values, or a
    constant one)."""
    x, y = x.double() - x.double().mean(), y.double() - y.double().mean()
    denominator = float(torch.sqrt(x.square().sum() * y.square().sum())) if x.numel() > 1 else 0.0
    return float((x * y).sum()) / denominator if denominator > 0 else 0.0


def mismatch_metrics(rollout_logprobs: torch.Tensor, old_logprobs: torch.Tensor,
                     response_lens: torch.Tensor, *, mask: torch.Tensor | None = None) -> dict[str, float]:
    """How far the trainer's policy (old logprobs) is from the rollout engine's on the same tokens. [T], [T], [B].

    verl's training/rollout_probs_diff_{mean,max,std} (|p_rollout - p_old|, unbiased std) and
    training/rollout_actor_probs_pearson_corr; training/rollout_mismatch_kl is the k3 estimate of
    KL(pi_rollout || pi_old) (samples are the rollout's); training/rollout_is_ratio/* and
    training/rollout_is_seq_ratio/* describe the raw weights pi_old / pi_rollout per token and per
    (non-empty) response, before any truncation, whether or not algorithm.rollout_correction is on.
    With a loss ``mask`` [T] they describe its tokens only (a response's ratio: over its trained tokens).
    """
    seq_ratio = rollout_log_ratio(old_logprobs, rollout_logprobs, response_lens, level="sequence", mask=mask).exp()
    if mask is not None:
        rollout_logprobs, old_logprobs = rollout_logprobs[mask], old_logprobs[mask]
    rollout_probs, old_probs = rollout_logprobs.exp(), old_logprobs.exp()
    probs_diff = (rollout_probs - old_probs).abs()
    token_ratio = rollout_log_ratio(old_logprobs, rollout_logprobs, response_lens, level="token").exp()
    kl = kl_penalty(rollout_logprobs, old_logprobs, "k3")
    return {
        "training/rollout_probs_diff_mean": float(probs_diff.mean()) if probs_diff.numel() else 0.0,
        "training/rollout_probs_diff_max": float(probs_diff.max()) if probs_diff.numel() else 0.0,
        "training/rollout_probs_diff_std": float(probs_diff.std()) if probs_diff.numel() > 1 else 0.0,
        "training/rollout_actor_probs_pearson_corr": pearson(rollout_probs, old_probs),
        "training/rollout_mismatch_kl": float(kl.mean()) if kl.numel() else 0.0,
        **summary("training/rollout_is_ratio", token_ratio),
        **summary("training/rollout_is_seq_ratio", seq_ratio[response_lens > 0]),
    }
