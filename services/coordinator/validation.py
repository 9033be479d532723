"""Validation: a run's held-out prompts generated on its rollouts and scored by its reward services.

Choices:
- The same rollout and reward services as training, the sampling of
  actor_rollout_ref.rollout.val_kwargs (greedy by default), and one seed for
  every validation of a run: equal weights give equal samples, so a model
  exported from a step scores under ``coordctl eval`` what that step's
  validation measured.
- Every response must come from one weight version, the one validated: the
  loop holds the next weight sync back until the validation's generation is
  done (``PPOLoop.finish_validation``), and generation refuses older weights.
- Metrics under verl's names (``metrics.validation_metrics``), plus
  ``val/weight_version`` (which weights were measured) and
  ``timing_s/testing``; every response is kept with its prompt, score, the
  answer the scorer read and whether it is right.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from services.coordinator import generation
from services.run.data import Prompt
from services.coordinator.generation import Scoring
from services.coordinator.metrics import PromptResults, validation_metrics
from services.coordinator.reward_set import RewardSet
from services.coordinator.rollout_set import RolloutSet
from services.coordinator.settings import ValidationSettings
from services.coordinator.waiting import Notices


@dataclass(frozen=True)
class Validated:
    """One validation of a run: the weights after ``step`` (version ``version``) on the held-out prompts."""

    step: int
    version: int
    metrics: dict[str, float]
    samples: list[dict]  # one per response: data_source, prompt, response, ground_truth, score, acc, pred, version


async def run_validation(*, settings: ValidationSettings, prompts: list[Prompt], rollout_set: RolloutSet,
                         reward_set: RewardSet, tokenizer, notices: Notices, timeout_s: float, step: int,
                         version: int) -> Validated:
    """Generate every prompt's responses from weight version ``version`` and score them."""
    started = time.perf_counter()
    generated, _ = await generation.generate(rollout_set, prompts, settings.sampling, settings.seed, version, timeout_s,
                                             notices, f"the validation of step {step}")
    scoring = await generation.score(reward_set, generated, tokenizer, notices, f"the validation of step {step}")
    metrics = await asyncio.to_thread(validation_metrics, prompt_results(scoring))
    metrics |= {"val/weight_version": float(version), "timing_s/testing": time.perf_counter() - started}
    return Validated(step, version, metrics, sample_records(scoring))


def prompt_results(scoring: Scoring) -> list[PromptResults]:
    """The scores, judgements and answers of each prompt's n responses."""
    n, results = scoring.rollouts.n, []
    for index, prompt in enumerate(scoring.rollouts.prompts):
        scored = scoring.scores[index * n:(index + 1) * n]
        accs = [s.acc for s in scored]
        results.append(PromptResults(prompt.data_source, [s.score for s in scored],
                                     None if None in accs else [bool(a) for a in accs], [s.pred for s in scored]))
    return results


def sample_records(scoring: Scoring) -> list[dict]:
    versions = scoring.rollouts.versions.tolist()
    return [{"data_source": sample.data_source, "prompt": sample.prompt, "response": sample.response,
             "ground_truth": sample.ground_truth, "score": scored.score, "acc": scored.acc, "pred": scored.pred,
             "valid": scored.valid, "weight_version": version}
            for sample, scored, version in zip(scoring.samples, scoring.scores, versions)]


def headline(validated: Validated) -> str:
    """The validation in a line for a person: each data source's mean reward (and accuracy) over its prompts."""
    core = {key.removeprefix("val-core/"): value for key, value in validated.metrics.items()
            if key.startswith("val-core/") and "/mean@" in key}
    parts = [f"{name} {value:.3f}" for name, value in sorted(core.items())]
    return f"validation of step {validated.step} (weight version {validated.version}): {', '.join(parts)}"
