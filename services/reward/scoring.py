"""What a reward service scores with: per data_source, a weighted sum of components.

A component is a built-in rule (``services/reward/rules.py``), a user's
function (``services/reward/plugins.py``) or a reward model
(``services/reward/reward_model.py``, batched over the samples that use it). A data_source the config does
not name uses ``default`` when given, else the built-in rule registered
under the data_source's own name. Each sample is scored on its own: an error
or a timeout in any of its components marks that sample invalid (score 0,
with the error), and the rest of the batch is unaffected. Besides its score, a
sample carries the answer read in its response and whether it is right
(verl's ``pred`` and ``acc``, for validation metrics): from the first
component that gives them (a rule: its reading and its full marks; a user's
function: the ``acc`` and ``pred`` it returns; a reward model gives neither).
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass

from services.reward import rules
from services.reward.config import ComponentConfig, RewardServiceConfig
from services.reward.plugins import FunctionWorkers
from services.reward.reward_model import RewardModel


@dataclass(frozen=True)
class Sample:
    """One response to score."""

    data_source: str  # routes the sample to its scorer (verl's data_source)
    response: str  # decoded
    ground_truth: str
    extra_info: dict  # the dataset row's extra_info (user functions receive it)
    prompt: str  # decoded: what a reward model reads before the response


@dataclass(frozen=True)
class SampleResult:
    score: float
    valid: bool
    error: str
    seconds: float
    acc: bool | None = None  # whether the answer is right, from the first component that says (None: none does)
    pred: str = ""  # the answer read in the response, from the first component that reads one
    components: tuple[tuple[str, float, float], ...] = ()  # (name, weight, value) of each part of the score


@dataclass(frozen=True)
class ComponentScore:
    """One component's part of a sample's score."""

    value: float
    acc: bool | None = None
    pred: str = ""


def rule_answer(component: ComponentConfig, response: str) -> str:
    """What a rule reads as the response's answer ("" for none), with the options its reading takes (gsm8k's
    method)."""
    read = rules.ANSWERS[component.rule]
    accepted = set(inspect.signature(read).parameters) if component.options else set()
    answer = read(response, **{k: v for k, v in component.options.items() if k in accepted})
    return answer or ""


class Scorer:
    def __init__(self, config: RewardServiceConfig):
        self.config = config
        components = [c for group in [*config.scorers.values(), config.default or []] for c in group]
        for component in components:
            if component.rule and component.rule not in rules.SCORERS:
                raise ValueError(f"unknown rule {component.rule!r}; known: {sorted(rules.SCORERS)}")
            if component.options:
                accepted = set(inspect.signature(rules.SCORERS[component.rule]).parameters) - {"solution_str",
                                                                                                "ground_truth"}
                unknown = sorted(set(component.options) - accepted)
                if unknown:
                    raise ValueError(f"rule {component.rule} has no options {unknown}; it takes {sorted(accepted)}")
        self.functions = {ref: FunctionWorkers(ref, config.function_workers, config.sample_timeout_s)
                          for ref in sorted({c.function for c in components if c.function})}
        self.reward_models = {path: RewardModel(path, config.device, config.reward_model_batch_size)
                              for path in sorted({c.reward_model for c in components if c.reward_model})}

    def components_for(self, data_source: str) -> list[ComponentConfig]:
        if data_source in self.config.scorers:
            return self.config.scorers[data_source]
        if self.config.default:
            return self.config.default
        if data_source in rules.SCORERS:
            return [ComponentConfig(rule=data_source)]
        raise ValueError(f"no scorer for data_source {data_source!r}; configured: {sorted(self.config.scorers)}, "
                         f"built-in rules: {sorted(rules.SCORERS)}")

    def score_batch(self, samples: list[Sample]) -> list[SampleResult]:
        """Blocking: each sample's weighted score, or an invalid result with its error. Reward models see the
        batch at once; the rest go sample by sample."""
        model_scores = self._reward_model_scores(samples)
        return [self._score_one(index, sample, model_scores) for index, sample in enumerate(samples)]

    def _reward_model_scores(self, samples: list[Sample]) -> dict[tuple[str, int], float | Exception]:
        wanted: dict[str, list[int]] = {}
        for index, sample in enumerate(samples):
            try:
                for component in self.components_for(sample.data_source):
                    if component.reward_model:
                        wanted.setdefault(component.reward_model, []).append(index)
            except ValueError:
                continue  # reported when the sample itself is scored
        scores: dict[tuple[str, int], float | Exception] = {}
        for path, indices in wanted.items():
            try:
                values = self.reward_models[path].score([samples[i].prompt + samples[i].response for i in indices])
            except Exception as error:  # noqa: BLE001 - the samples that needed it become invalid
                values = [error] * len(indices)
            scores.update({(path, i): v for i, v in zip(indices, values)})
        return scores

    def _score_one(self, index: int, sample: Sample, model_scores) -> SampleResult:
        started = time.perf_counter()
        try:
            parts = [(component, self._component_score(component, index, sample, model_scores))
                     for component in self.components_for(sample.data_source)]
            acc = next((part.acc for _, part in parts if part.acc is not None), None)
            pred = next((part.pred for _, part in parts if part.pred), "")
            components = tuple((component.name, component.weight, part.value) for component, part in parts)
            return SampleResult(sum(weight * value for _, weight, value in components), True, "",
                                time.perf_counter() - started, acc, pred, components)
        except Exception as error:  # noqa: BLE001 - one bad sample must not fail the batch
            return SampleResult(0.0, False, f"{type(error).__name__}: {error}", time.perf_counter() - started)

    def _component_score(self, component: ComponentConfig, index: int, sample: Sample, model_scores) -> ComponentScore:
        if component.function:
            result = self.functions[component.function].score(sample.data_source, sample.response,
                                                              sample.ground_truth, sample.extra_info)
            return ComponentScore(result.score, result.acc, result.pred)
        if component.reward_model:
            value = model_scores[(component.reward_model, index)]
            if isinstance(value, Exception):
                raise value
            return ComponentScore(value)
        value = rules.SCORERS[component.rule](sample.response, sample.ground_truth, **component.options)
        if component.rule not in rules.ANSWERS:  # a rule of form, not of answers
            return ComponentScore(value)
        return ComponentScore(value, value >= 1.0, rule_answer(component, sample.response))

    def close(self) -> None:
        for workers in self.functions.values():
            workers.close()
