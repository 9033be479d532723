"""Step metrics under verl's names, from the tensors of one step (pure functions)."""

from __future__ import annotations

import torch

from services import algos


def summary(prefix: str, values: torch.Tensor) -> dict[str, float]:
    """{prefix}/mean, /max, /min of a tensor (zeros when it is empty)."""
    if values.numel() == 0:
        return {f"{prefix}/mean": 0.0, f"{prefix}/max": 0.0, f"{prefix}/min": 0.0}
    values = values.float()
    return {f"{prefix}/mean": float(values.mean()), f"{prefix}/max": float(values.max()), f"{prefix}/min": float(values.min())}


def pearson(x: torch.Tensor, y: torch.Tensor) -> float:
    """Pearson correlation of two equally long tensors; 0 where it is undefined (fewer than 2 values, or a
    constant one)."""
    x, y = x.double() - x.double().mean(), y.double() - y.double().mean()
    denominator = float(torch.sqrt(x.square().sum() * y.square().sum())) if x.numel() > 1 else 0.0
    return float((x * y).sum()) / denominator if denominator > 0 else 0.0


def mismatch_metrics(rollout_logprobs: torch.Tensor, old_logprobs: torch.Tensor,
                     response_lens: torch.Tensor) -> dict[str, float]:
    """How far the trainer's policy (old logprobs) is from the rollout engine's on the same tokens. [T], [T], [B].

    verl's training/rollout_probs_diff_{mean,max,std} (|p_rollout - p_old|, unbiased std) and
    training/rollout_actor_probs_pearson_corr; training/rollout_mismatch_kl is the k3 estimate of
    KL(pi_rollout || pi_old) (samples are the rollout's); training/rollout_is_ratio/* and
    training/rollout_is_seq_ratio/* describe the raw weights pi_old / pi_rollout per token and per
    (non-empty) response, before any truncation, whether or not algorithm.rollout_correction is on.
    """
    rollout_probs, old_probs = rollout_logprobs.exp(), old_logprobs.exp()
    probs_diff = (rollout_probs - old_probs).abs()
    token_ratio = algos.rollout_log_ratio(old_logprobs, rollout_logprobs, response_lens, "token").exp()
    seq_ratio = algos.rollout_log_ratio(old_logprobs, rollout_logprobs, response_lens, "sequence").exp()
    kl = algos.kl_penalty(rollout_logprobs, old_logprobs, "k3")
    return {
        "training/rollout_probs_diff_mean": float(probs_diff.mean()) if probs_diff.numel() else 0.0,
        "training/rollout_probs_diff_max": float(probs_diff.max()) if probs_diff.numel() else 0.0,
        "training/rollout_probs_diff_std": float(probs_diff.std()) if probs_diff.numel() > 1 else 0.0,
        "training/rollout_actor_probs_pearson_corr": pearson(rollout_probs, old_probs),
        "training/rollout_mismatch_kl": float(kl.mean()) if kl.numel() else 0.0,
        **summary("training/rollout_is_ratio", token_ratio),
        **summary("training/rollout_is_seq_ratio", seq_ratio[response_lens > 0]),
    }


def data_metrics(
    scores: torch.Tensor, rewards: torch.Tensor, advantages: torch.Tensor, returns: torch.Tensor,
    values: torch.Tensor | None, response_lens: torch.Tensor, prompt_lens: torch.Tensor, truncated: torch.Tensor,
    rollout_logprobs: torch.Tensor, old_logprobs: torch.Tensor,
) -> dict[str, float]:
    """One step's data under verl's names.

    Per sequence [B]: scores (critic/score), response and prompt lengths, truncated.
    Per token [T]: rewards (summed per sequence for critic/rewards), advantages,
    returns, values, and the rollout's and the trainer's logprobs of the same tokens
    (their mismatch: ``mismatch_metrics``).
    """
    metrics = {
        **summary("critic/score", scores),
        **summary("critic/rewards", algos.sequence_sums(rewards, response_lens)),
        **summary("critic/advantages", advantages),
        **summary("critic/returns", returns),
        **summary("response_length", response_lens),
        "response_length/clip_ratio": float(truncated.float().mean()) if truncated.numel() else 0.0,
        **summary("prompt_length", prompt_lens),
        **mismatch_metrics(rollout_logprobs, old_logprobs, response_lens),
    }
    if values is not None:
        metrics.update(summary("critic/values", values))
        metrics["critic/vf_explained_var"] = algos.explained_variance(returns, values)
    return metrics
