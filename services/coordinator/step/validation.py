"""Validation: a run's held-out prompts generated on its rollouts and scored by its reward services.

Choices:
- The same rollout and reward services as training, the sampling of
  actor_rollout_ref.rollout.val_kwargs (greedy by default), and one seed for
  every validation of a run: equal weights give equal samples, so a model
  exported from a step scores under ``coordctl eval`` what that step's
  validation measured.
- Every response must come from one weight version, the one validated: the
  loop holds the next weight sync back until the validation's generation is
  done (``Validations.finish``), and generation refuses older weights.
- When (``Validations``): before training (trainer.val_before_train), after
  every trainer.test_freq-th step and after the last, on the rollouts beside
  the next step's work.
- Metrics under verl's names (``metrics.validation_metrics``), plus
  ``val/weight_version`` (which weights were measured) and
  ``timing_s/testing``; every response is kept with its prompt, score, the
  answer the scorer read and whether it is right.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Protocol

from services.coordinator.step import generation
from services.coordinator.agent.agent_loop import AgentLoop
from services.run.data import Prompt
from services.coordinator.step.generation import Scoring
from services.coordinator.step.metrics import PromptResults, validation_metrics
from services.coordinator.fleet.reward_set import RewardSet
from services.coordinator.fleet.rollout_set import RolloutSet
from services.coordinator.settings import ValidationSettings
from services.coordinator.waiting import Notices


@dataclass(frozen=True, kw_only=True)
class Validated:
    """One validation of a run: the weights after ``step`` (version ``version``) on the held-out prompts."""

    step: int
    version: int
    metrics: dict[str, float]
    samples: list[dict]  # one per response: data_source, prompt, response, ground_truth, score, acc, pred, version


async def run_validation(*, settings: ValidationSettings, prompts: list[Prompt], rollout_set: RolloutSet,
                         reward_set: RewardSet, agent: AgentLoop | None, tokenizer, notices: Notices,
                         timeout_s: float, step: int, version: int) -> Validated:
    """Generate every prompt's responses (a multi-turn run: trajectories of ``agent``) from weight version
    ``version`` and score them."""
    started = time.perf_counter()
    agent_metrics: dict[str, float] = {}
    if agent is None:
        generated, _ = await generation.generate(rollout_set, prompts, settings.sampling, seed=settings.seed,
                                                 oldest=version,
                                                 timeout_s=timeout_s, notices=notices,
                                                 what=f"the validation of step {step}")
    else:
        generated, _, agent_metrics = await generation.generate_trajectories(
            agent, prompts, settings.sampling, seed=settings.seed, oldest=version, timeout_s=timeout_s,
            what=f"the validation of step {step}")
    scoring = await generation.score(reward_set, generated, tokenizer, notices=notices,
                                     what=f"the validation of step {step}")
    metrics = await asyncio.to_thread(validation_metrics, prompt_results(scoring))
    metrics |= {"val/weight_version": float(version), "timing_s/testing": time.perf_counter() - started,
                **{f"val/{name}": value for name, value in agent_metrics.items()}}
    return Validated(step=step, version=version, metrics=metrics, samples=sample_records(scoring))


class ValidationNotices(Notices, Protocol):
    def validation(self, validated: Validated) -> None:
        """A validation is done: its metrics (recorded with its step's) and every response it scored."""


class Validations:
    """When a run validates, and the validation in progress: it generates on the rollouts while the loop goes on,
    and the next weight sync waits for it (``finish``)."""

    def __init__(self, *, settings: ValidationSettings | None, total_steps: int, prompts: list[Prompt],
                 rollout_set: RolloutSet, reward_set: RewardSet, agent: AgentLoop | None, tokenizer,
                 notices: ValidationNotices, timeout_s: float):
        """``settings``: None for a run without held-out prompts (it never validates); ``prompts``: the held-out
        ones; ``agent``: a multi-turn run's agent loop (None: one response per prompt)."""
        self.settings, self.total_steps, self.prompts = settings, total_steps, prompts
        self.rollout_set, self.reward_set, self.agent, self.tokenizer = rollout_set, reward_set, agent, tokenizer
        self.notices, self.timeout_s = notices, timeout_s
        self.in_progress: asyncio.Task | None = None  # a validation generating on the rollouts

    def due(self, step: int) -> bool:
        """Validate after every trainer.test_freq-th step and after the last."""
        settings = self.settings
        return (settings is not None and settings.test_freq > 0
                and (step % settings.test_freq == 0 or step == self.total_steps))

    def start(self, step: int) -> None:
        """Validate the weights the rollouts serve now, after step ``step``, on the rollouts, while the loop goes
        on (the next weight sync waits for it: ``finish``); only for a run that validates (its settings given)."""
        settings = self.settings
        assert settings is not None, "validation starts only for a run with held-out prompts"

        async def run_and_report() -> None:
            validated = await run_validation(
                settings=settings,
                prompts=self.prompts, rollout_set=self.rollout_set,
                reward_set=self.reward_set, agent=self.agent, tokenizer=self.tokenizer, notices=self.notices,
                timeout_s=self.timeout_s,
                step=step, version=self.rollout_set.served)
            self.notices.validation(validated)

        self.in_progress = asyncio.ensure_future(run_and_report())

    async def finish(self) -> None:
        """Wait for the validation in progress: the rollouts must serve the weights it measures until it is done
        (its failure is raised here)."""
        if self.in_progress is not None:
            task, self.in_progress = self.in_progress, None
            await task

    async def cancel(self) -> None:
        """Give up the validation in progress (the loop ends without waiting for it)."""
        if self.in_progress is not None:
            self.in_progress.cancel()
            await asyncio.gather(self.in_progress, return_exceptions=True)


def prompt_results(scoring: Scoring) -> list[PromptResults]:
    """The scores, judgements and answers of each prompt's n responses."""
    n, results = scoring.rollouts.n, []
    for index, prompt in enumerate(scoring.rollouts.prompts):
        scored = scoring.scores[index * n:(index + 1) * n]
        accs = [s.acc for s in scored]
        results.append(PromptResults(data_source=prompt.data_source, scores=[s.score for s in scored],
                                     accs=None if None in accs else [bool(a) for a in accs],
                                     preds=[s.pred for s in scored]))
    return results


def sample_records(scoring: Scoring) -> list[dict]:
    versions = scoring.rollouts.versions[scoring.rollouts.first_rows].tolist()  # each trajectory's first token
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
