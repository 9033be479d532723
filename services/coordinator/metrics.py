"""Step metrics under verl's names, from the tensors of one step (pure functions)."""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch

from services import algos


def summary(prefix: str, values: torch.Tensor) -> dict[str, float]:
    """{prefix}/mean, /max, /min of a tensor (zeros when it is empty)."""
    if values.numel() == 0:
        return {f"{prefix}/mean": 0.0, f"{prefix}/max": 0.0, f"{prefix}/min": 0.0}
    values = values.float()
    return {f"{prefix}/mean": float(values.mean()), f"{prefix}/max": float(values.max()), f"{prefix}/min": float(values.min())}


def data_metrics(
    scores: torch.Tensor, rewards: torch.Tensor, advantages: torch.Tensor, returns: torch.Tensor,
    values: torch.Tensor | None, response_lens: torch.Tensor, prompt_lens: torch.Tensor, truncated: torch.Tensor,
    rollout_logprobs: torch.Tensor, old_logprobs: torch.Tensor,
) -> dict[str, float]:
    """One step's data under verl's names.

    Per sequence [B]: scores (critic/score), response and prompt lengths, truncated.
    Per token [T]: rewards (summed per sequence for critic/rewards), advantages,
    returns, values, and the rollout's and the trainer's logprobs of the same tokens.
    """
    probs_diff = (rollout_logprobs.exp() - old_logprobs.exp()).abs()
    metrics = {
        **summary("critic/score", scores),
        **summary("critic/rewards", algos.sequence_sums(rewards, response_lens)),
        **summary("critic/advantages", advantages),
        **summary("critic/returns", returns),
        **summary("response_length", response_lens),
        "response_length/clip_ratio": float(truncated.float().mean()) if truncated.numel() else 0.0,
        **summary("prompt_length", prompt_lens),
        "training/rollout_probs_diff_mean": float(probs_diff.mean()) if probs_diff.numel() else 0.0,
        "training/rollout_probs_diff_max": float(probs_diff.max()) if probs_diff.numel() else 0.0,
    }
    if values is not None:
        metrics.update(summary("critic/values", values))
        metrics["critic/vf_explained_var"] = algos.explained_variance(returns, values)
    return metrics


class StageTimer:
    """Wall time of each stage of a step: ``with timer("gen"): ...`` -> timing_s/gen."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._started = time.perf_counter()

    @contextmanager
    def __call__(self, stage: str):
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[stage] = self.seconds.get(stage, 0.0) + time.perf_counter() - started

    async def timed(self, stage: str, awaitable):
        """Await ``awaitable``, recording its time as ``stage`` (for stages that run concurrently)."""
        with self(stage):
            return await awaitable

    def metrics(self) -> dict[str, float]:
        total = time.perf_counter() - self._started
        return {**{f"timing_s/{stage}": s for stage, s in self.seconds.items()}, "timing_s/step": total}
