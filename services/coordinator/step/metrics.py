"""Step and validation metrics under verl's names, from the tensors and scores of one step or one validation
(pure functions); those of the rollout/trainer mismatch are services/algos.mismatch_metrics."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import torch

from services import algos
from services.algos import mismatch_metrics, summary


def data_metrics(
    scores: torch.Tensor, rewards: torch.Tensor, advantages: torch.Tensor, *, returns: torch.Tensor,
    values: torch.Tensor | None, response_lens: torch.Tensor, prompt_lens: torch.Tensor, truncated: torch.Tensor,
    rollout_logprobs: torch.Tensor, old_logprobs: torch.Tensor | None, loss_mask: torch.Tensor | None = None,
) -> dict[str, float]:
    """One step's data under verl's names.

    Per sequence [B]: scores (critic/score), response and prompt lengths, truncated.
    Per token [T]: rewards (summed per sequence for critic/rewards), advantages,
    returns, values, and the rollout's and the trainer's logprobs of the same tokens
    (their mismatch: ``mismatch_metrics``; old_logprobs None: the actor's update took
    its own and reported the mismatch itself). With a ``loss_mask`` [T] (multi-turn) the per-token ones
    describe the model's tokens only.
    """
    if loss_mask is not None:
        advantages, returns = advantages[loss_mask], returns[loss_mask]
        values = None if values is None else values[loss_mask]
    metrics = {
        **summary("critic/score", scores),
        **summary("critic/rewards", algos.sequence_sums(rewards, response_lens)),
        **summary("critic/advantages", advantages),
        **summary("critic/returns", returns),
        **summary("response_length", response_lens),
        "response_length/clip_ratio": float(truncated.float().mean()) if truncated.numel() else 0.0,
        **summary("prompt_length", prompt_lens),
    }
    if old_logprobs is not None:
        metrics.update(mismatch_metrics(rollout_logprobs, old_logprobs, response_lens, mask=loss_mask))
    if values is not None:
        metrics.update(summary("critic/values", values))
        metrics["critic/vf_explained_var"] = algos.explained_variance(returns, values)
    return metrics


# ---------------------------------------------------------------------------- validation (verl's val-core/val-aux)


def throughput(tokens: int, step_s: float, devices: int) -> float:
    """Tokens per second per device (verl's and NeMo-RL's perf/throughput): the step's tokens, prompts and
    responses, over its seconds, over the devices the run computes on."""
    return tokens / step_s / devices


def rollout_balance(counts: dict[str, float], tokens_per_s: dict[str, float]) -> dict[str, float]:
    """How a step's generation was spread, from its ``rollout/samples_by/<address>`` counts: each rollout's share
    of the samples as ``rollout/share/<address>``, and its measured speed (``tokens_per_s``: address -> speed), on
    which its next share is based, as ``rollout/tokens_per_s/<address>``."""
    prefix = "rollout/samples_by/"
    samples_by = {name.removeprefix(prefix): count for name, count in counts.items() if name.startswith(prefix)}
    total = sum(samples_by.values())
    return {**{f"rollout/share/{address}": count / total for address, count in samples_by.items() if total},
            **{f"rollout/tokens_per_s/{address}": tokens_per_s[address] for address in samples_by
               if address in tokens_per_s}}


@dataclass(frozen=True, kw_only=True)
class PromptResults:
    """What validation got for one prompt: its n responses' scores, and what the scorer read and judged."""

    data_source: str
    scores: list[float]
    accs: list[bool] | None  # None: the scorer does not judge answers (a reward model)
    preds: list[str]  # the answer read in each response ("" for none)


def sample_counts(n: int) -> list[int]:
    """The k of best@k, worst@k and maj@k for n responses a prompt: 2, 4, 8, ... below n, then n (none for 1)."""
    if n <= 1:
        return []
    counts, k = [], 2
    while k < n:
        counts.append(k)
        k *= 2
    return [*counts, n]


def best_of_k(values: list[float], k: int) -> tuple[float, float]:
    """Mean and std of the best of k values drawn with replacement from ``values``, exactly (verl estimates
    both with 1000 bootstrap draws). With the values sorted, v_1 <= ... <= v_n, the best of k is v_i with
    probability (i/n)^k - ((i-1)/n)^k."""
    ordered, n = sorted(values), len(values)
    chances = [((i + 1) / n) ** k - (i / n) ** k for i in range(n)]
    mean = sum(p * v for p, v in zip(chances, ordered))
    second = sum(p * v * v for p, v in zip(chances, ordered))
    return mean, math.sqrt(max(0.0, second - mean * mean))


def worst_of_k(values: list[float], k: int) -> tuple[float, float]:
    """Mean and std of the worst of k values drawn with replacement, exactly (``best_of_k`` of the negatives)."""
    mean, std = best_of_k([-v for v in values], k)
    return -mean, std


def majority_of_k(values: list[float], preds: list[str], k: int, *, draws: int = 1000,
                  seed: int = 42) -> tuple[float, float]:
    """Mean and std, over ``draws`` seeded bootstrap draws of k of the responses (with replacement, as verl's),
    of the value of the majority answer: the answer most of the k read (a tie goes to the answer the prompt's
    responses read first), valued as the first response that read it."""
    answers = list(dict.fromkeys(preds))  # in order of first reading
    answer_of = torch.tensor([answers.index(p) for p in preds])
    value_of_answer = torch.tensor([values[preds.index(a)] for a in answers], dtype=torch.float64)
    picks = torch.randint(len(values), (draws, k), generator=torch.Generator().manual_seed(seed))
    votes = torch.nn.functional.one_hot(answer_of[picks], len(answers)).sum(dim=1)  # [draws, answers]
    majority = value_of_answer[votes.argmax(dim=1)]  # argmax takes the first of tied answers
    return float(majority.mean()), float(majority.std(unbiased=False))


def pass_at_k(n: int, correct: int, k: int) -> float:
    """The chance that k of n responses drawn without replacement hold a right one when ``correct`` are right:
    1 - C(n - c, k) / C(n, k), the unbiased estimator of pass@k (Chen et al., 2021)."""
    if n - correct < k:
        return 1.0
    return 1.0 - math.comb(n - correct, k) / math.comb(n, k)


def prompt_metrics(values: list[float], preds: list[str] | None, correct: int | None) -> dict[str, float]:
    """One prompt's metrics of one variable (its n responses' values): mean@n, std@n, best@k, worst@k, maj@k
    (with ``preds``) and pass@k (with ``correct``, the right responses) for k of ``sample_counts(n)``."""
    n = len(values)
    metrics = {f"mean@{n}": sum(values) / n}
    if n > 1:
        metrics[f"std@{n}"] = statistics.pstdev(values)
    for k in sample_counts(n):
        (best, best_std), (worst, worst_std) = best_of_k(values, k), worst_of_k(values, k)
        metrics |= {f"best@{k}/mean": best, f"best@{k}/std": best_std,
                    f"worst@{k}/mean": worst, f"worst@{k}/std": worst_std}
        if preds is not None:
            metrics[f"maj@{k}/mean"], metrics[f"maj@{k}/std"] = majority_of_k(values, preds, k)
    if correct is not None:
        metrics |= {f"pass@{k}": pass_at_k(n, correct, k) for k in [1, *sample_counts(n)]}
    return metrics


def validation_metrics(results: list[PromptResults]) -> dict[str, float]:
    """A validation's metrics under verl's names, each the mean over a data source's prompts.

    Variables: ``reward`` (the scores) and, where the scorer judges answers, ``acc`` (1 for a right one). For
    each, ``prompt_metrics``. The most telling (mean@n, best@n and maj@n, n the responses a prompt) are
    ``val-core/<data_source>/<variable>/<metric>``, the rest ``val-aux/...``. verl puts only one variable in
    val-core (acc when there is one, else reward); here both are, so val-core/<data_source>/reward/mean@n is
    there for every scorer."""
    by_metric: dict[str, list[float]] = {}
    for prompt in results:
        preds = prompt.preds if any(prompt.preds) else None
        variables: dict[str, tuple[list[float], int | None]] = {"reward": (prompt.scores, None)}
        if prompt.accs is not None:
            variables["acc"] = ([float(a) for a in prompt.accs], sum(prompt.accs))
        for name, (values, correct) in variables.items():
            n = len(values)
            for metric, value in prompt_metrics(values, preds, correct).items():
                core = metric.split("/")[0] in (f"mean@{n}", f"best@{n}", f"maj@{n}")
                key = f"{'val-core' if core else 'val-aux'}/{prompt.data_source}/{name}/{metric}"
                by_metric.setdefault(key, []).append(value)
    return {key: sum(values) / len(values) for key, values in by_metric.items()}
