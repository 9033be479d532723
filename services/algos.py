"""RL math for meshrl: pure functions on tensors.

Choices, stated before the code:

- Sequences travel padding-free: a batch of B responses is one flat tensor of
  all response tokens plus ``lengths`` [B]. Token-level tensors in this module
  are therefore flat ``[T]`` with ``T = lengths.sum()``; per-sequence tensors are
  ``[B]``.
- GRPO's advantage is the sequence's score minus its group's mean score,
  divided by the group's standard deviation (unbiased, as ``torch.std``, the
  way verl computes it) plus ``eps``; a group of one gets advantage 0. Every
  token of a response carries its sequence's advantage.
- The PPO policy loss is the clipped surrogate with separate lower and upper
  clip ranges; losses are aggregated as ``token-mean`` over the tokens of the
  whole mini-batch, so micro-batches pass the mini-batch token count as
  ``num_tokens`` and their gradients sum to the full mini-batch gradient.

No config objects, no I/O: everything arrives as plain arguments.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


def expand_per_token(per_sequence: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Repeat a per-sequence value over that sequence's tokens.

    per_sequence: [B]; lengths: [B] int -> [lengths.sum()].
    """
    return torch.repeat_interleave(per_sequence, lengths)


def grpo_advantages(
    scores: torch.Tensor,
    group_ids: torch.Tensor,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Group-normalised advantage of each sequence (GRPO).

    scores: [B] float, one scalar reward per sequence.
    group_ids: [B] int, sequences sampled from the same prompt share an id.
    Returns [B]: (score - group mean) / (group std + eps), or without the
    division when ``norm_by_std`` is False (Dr. GRPO). Groups of size 1 get 0.
    """
    scores = scores.to(torch.float64)
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    sums = torch.zeros(len(counts), dtype=torch.float64).index_add_(0, inverse, scores)
    means = sums / counts
    centred = scores - means[inverse]
    squares = torch.zeros(len(counts), dtype=torch.float64).index_add_(0, inverse, centred**2)
    std = torch.sqrt(squares / (counts - 1).clamp(min=1))
    advantages = centred / (std[inverse] + eps) if norm_by_std else centred
    advantages = torch.where(counts[inverse] > 1, advantages, torch.zeros_like(advantages))
    return advantages.to(torch.float32)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-probability of each token under temperature-scaled logits, in fp32.

    logits: [..., V]; tokens: [...] int -> [...] float32.
    """
    scaled = logits.float() / temperature
    return torch.log_softmax(scaled, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of the temperature-scaled distribution at each position. [..., V] -> [...]."""
    log_probs = torch.log_softmax(logits.float() / temperature, dim=-1)
    return -(log_probs.exp() * log_probs).sum(-1)


class PolicyLoss(NamedTuple):
    loss: torch.Tensor  # scalar, token-mean over num_tokens
    clipfrac: torch.Tensor  # share of tokens whose surrogate was clipped
    approx_kl: torch.Tensor  # mean of (old_logprob - logprob), verl's actor/ppo_kl


def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    num_tokens: int | None = None,
) -> PolicyLoss:
    """PPO clipped surrogate loss, aggregated as token-mean.

    logprobs, old_logprobs, advantages: [T] (flat response tokens).
    num_tokens: the divisor of the sum; pass the mini-batch's token count when
    this is one micro-batch of it (defaults to T).
    loss_t = max(-A_t * r_t, -A_t * clip(r_t, 1 - low, 1 + high)), r_t = exp(logp - old_logp).
    """
    divisor = num_tokens if num_tokens is not None else logprobs.numel()
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    per_token = torch.maximum(unclipped, clipped)
    with torch.no_grad():
        clipfrac = (clipped > unclipped).float().sum() / divisor
        approx_kl = (-log_ratio).sum() / divisor
    return PolicyLoss(per_token.sum() / divisor, clipfrac, approx_kl)


def sequence_nll(logprobs: torch.Tensor, num_tokens: int | None = None) -> torch.Tensor:
    """Supervised loss: mean negative log-likelihood of the target tokens. [T] -> scalar."""
    divisor = num_tokens if num_tokens is not None else logprobs.numel()
    return -logprobs.sum() / divisor
