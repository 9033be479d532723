"""What a reward service scores with: per data_source, a weighted sum of components.

A component is a built-in rule (``services/reward/rules.py``), a code-contest
rule (``services/reward/code_contests.py``), a user's
function (``services/reward/plugins.py``) or a reward model
(``services/reward/reward_model.py``, batched over the samples that use it). A data_source the config does
not name uses ``default`` when given, else the built-in rule registered
under the data_source's own name. Each sample is scored on its own: an error
or a timeout in any of its components marks that sample invalid (score 0,
with the error), and the rest of the batch is unaffected; but a rule that runs
out of time gives its failure value (``rules.FAILURE_SCORE``): a response it
cannot read in time has no answer it accepts. Rules and user functions run in
worker processes under ``sample_timeout_s``; a sample that ran out of time in
any component says so (``timed_out``). A code-contest rule runs each test case of a
sample in the code sandbox (``services/common/sandbox.py``), from a pool of
``sandbox.concurrent_runs`` threads, each case bounded by ``sandbox.wall_s``;
a service configured with such a rule refuses to start where the sandbox
cannot be had, and a sample that reaches one otherwise (its data_source named
no rule, so the built-in of its name applies) is invalid with the reason:
code never runs unsandboxed. Besides its score, a
sample carries the answer read in its response and whether it is right
(verl's ``pred`` and ``acc``, for validation metrics): from the first
component that gives them (a rule: its reading and its full marks; a user's
function: the ``acc`` and ``pred`` it returns; a reward model gives neither).
"""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from services.common.sandbox import SandboxResult, SandboxUnavailable, check_sandbox, run_in_sandbox
from services.reward import code_contests, rules
from services.reward.config import ComponentConfig, RewardServiceConfig
from services.reward.plugins import FunctionScore, FunctionWorkers

if TYPE_CHECKING:
    from services.reward.reward_model import RewardModel


@dataclass(frozen=True, kw_only=True)
class Sample:
    """One response to score."""

    data_source: str  # routes the sample to its scorer (verl's data_source)
    response: str  # decoded
    ground_truth: str
    extra_info: dict  # the dataset row's extra_info (user functions receive it)
    prompt: str  # decoded: what a reward model reads before the response


@dataclass(frozen=True, kw_only=True)
class SampleResult:
    score: float
    valid: bool
    error: str
    seconds: float
    acc: bool | None = None  # whether the answer is right, from the first component that says (None: none does)
    pred: str = ""  # the answer read in the response, from the first component that reads one
    components: tuple[tuple[str, float, float], ...] = ()  # (name, weight, value) of each part of the score
    timed_out: bool = False  # some component ran out of time on it


@dataclass(frozen=True, kw_only=True)
class ComponentScore:
    """One component's part of a sample's score."""

    value: float
    acc: bool | None = None
    pred: str = ""
    timed_out: bool = False
    seconds: float = 0.0  # its worker's time on it (a reward model's batch is not counted)


RULES = "services.reward.rules:judge"
SYMBOLIC_WARM_UP: tuple[str, dict[str, Any], str, str] = ("math", {}, "\\boxed{\\frac{1}{2}}", "0.5")
"""A rules worker's first call to a symbolic rule imports math-verify and builds its parser: seconds, which no
sample's timeout should pay for."""


def load_reward_models(paths: list[str], config: RewardServiceConfig) -> dict[str, RewardModel]:
    """The reward models in the folders ``paths``, by path. Only a service that has one imports torch and
    transformers (seconds of CPU at each start otherwise)."""
    if not paths:
        return {}
    from services.reward.reward_model import RewardModel

    return {path: RewardModel(path, config.device, config.reward_model_batch_size) for path in paths}


class Scorer:
    def __init__(self, config: RewardServiceConfig):
        self.config = config
        components = [c for group in [*config.scorers.values(), config.default or []] for c in group]
        for component in components:
            if component.rule in code_contests.CODE_RULES:
                code_contests.check_options(component.rule, component.options)
                continue
            if component.rule and component.rule not in rules.SCORERS:
                raise ValueError(f"unknown rule {component.rule!r}; known: "
                                 f"{sorted([*rules.SCORERS, *code_contests.CODE_RULES])}")
            if component.rule and component.options:  # (options are for rules only)
                accepted = set(inspect.signature(rules.SCORERS[component.rule]).parameters) - {"solution_str",
                                                                                                "ground_truth"}
                unknown = sorted(set(component.options) - accepted)
                if unknown:
                    raise ValueError(f"rule {component.rule} has no options {unknown}; it takes {sorted(accepted)}")
        code_rules = sorted({c.rule for c in components if c.rule in code_contests.CODE_RULES})
        if code_rules and self.sandbox_refusal is not None:
            raise ValueError(f"rules {code_rules} run the response's code in the sandbox, which this host cannot "
                             f"give: {self.sandbox_refusal}")
        self.functions = {ref: FunctionWorkers(ref, config.function_workers, config.sample_timeout_s)
                          for ref in sorted({c.function for c in components if c.function})}
        self.rules = FunctionWorkers(RULES, config.function_workers, config.sample_timeout_s)
        self.reward_models = load_reward_models(sorted({c.reward_model for c in components if c.reward_model}),
                                                config)
        self.sandbox_limits = config.sandbox.limits()
        self._sandbox_runs = ThreadPoolExecutor(config.sandbox.concurrent_runs, thread_name_prefix="sandbox")

    @functools.cached_property
    def sandbox_refusal(self) -> str | None:
        """Why this host cannot run the code-contest rules (None: it can): checked at start when the config names
        one, else when a sample first needs one."""
        return check_sandbox()

    def components_for(self, data_source: str) -> list[ComponentConfig]:
        if data_source in self.config.scorers:
            return self.config.scorers[data_source]
        if self.config.default:
            return self.config.default
        if data_source in rules.SCORERS or data_source in code_contests.CODE_RULES:
            return [ComponentConfig(rule=data_source)]
        raise ValueError(f"no scorer for data_source {data_source!r}; configured: {sorted(self.config.scorers)}, "
                         f"built-in rules: {sorted(rules.SCORERS)}")

    def score_batch(self, samples: list[Sample]) -> list[SampleResult]:
        """Blocking: each sample's weighted score, or an invalid result with its error. Reward models see the
        batch at once, and each pool of worker processes (the rules', a user function's) its part of it."""
        model_scores = self._reward_model_scores(samples)
        judged = {**self._worker_results(samples), **self._code_results(samples)}
        return [self._score_one(index, sample, model_scores, judged=judged) for index, sample in enumerate(samples)]

    def _worker_results(self, samples: list[Sample]) -> dict[tuple[int, int], FunctionScore | Exception]:
        """(sample index, component position) -> what the workers said, for each component that is a rule or a
        user's function."""
        tasks: dict[FunctionWorkers, list[tuple[tuple[int, int], tuple]]] = {}
        for index, position, component in self._components(samples):
            sample = samples[index]
            arguments: tuple[Any, ...]
            if component.rule in code_contests.CODE_RULES:
                continue  # run by _code_results
            if component.rule:
                arguments = (component.rule, component.options, sample.response, sample.ground_truth)
                tasks.setdefault(self.rules, []).append(((index, position), arguments))
            elif component.function:
                arguments = (sample.data_source, sample.response, sample.ground_truth, sample.extra_info)
                tasks.setdefault(self.functions[component.function], []).append(((index, position), arguments))
        results: dict[tuple[int, int], FunctionScore | Exception] = {}
        for workers, keyed in tasks.items():
            calls = [arguments for _, arguments in keyed]
            symbolic = workers is self.rules and any(call[0] in rules.SYMBOLIC_RULES for call in calls)
            answers = workers.score_all(calls, SYMBOLIC_WARM_UP if symbolic else None)
            results.update(zip([key for key, _ in keyed], answers))
        return results

    def _code_results(self, samples: list[Sample]) -> dict[tuple[int, int], FunctionScore | Exception]:
        """(sample index, component position) -> the verdict of each component that is a code-contest rule; the
        cases of all of them are queued on the sandbox threads at once, then awaited."""
        results: dict[tuple[int, int], FunctionScore | Exception] = {}
        queued: dict[tuple[int, int], tuple[ComponentConfig, code_contests.CodeTask, list[Future]]] = {}
        for index, position, component in self._code_components(samples):
            sample = samples[index]
            try:
                if self.sandbox_refusal is not None:
                    raise ValueError(f"rule {component.rule} runs the response's code in the sandbox, which this "
                                     f"host cannot give: {self.sandbox_refusal}")
                max_cases = int(component.options.get("max_cases", code_contests.MAX_CASES))
                task = code_contests.code_task(sample.response, sample.ground_truth, max_cases=max_cases)
            except ValueError as error:
                results[(index, position)] = error
                continue
            if task is None:
                nothing = code_contests.NO_PROGRAM
                results[(index, position)] = FunctionScore(score=nothing.score, acc=nothing.acc, pred=nothing.pred)
                continue
            runs = [self._sandbox_runs.submit(run_in_sandbox, task.program, self.sandbox_limits, case.stdin,
                                              files=task.files) for case in task.cases]
            queued[(index, position)] = (component, task, runs)
        for key, (component, task, runs) in queued.items():
            try:
                ran: list[SandboxResult] = [run.result() for run in runs]
            except (SandboxUnavailable, ValueError) as error:
                results[key] = error
                continue
            verdicts = [code_contests.verdict(result, case, task.call_based) for result, case in zip(ran, task.cases)]
            answer = code_contests.code_score(verdicts, bool(component.options.get("all_or_nothing", False)))
            results[key] = FunctionScore(score=answer.score, acc=answer.acc, pred=answer.pred,
                                         seconds=sum(result.seconds for result in ran))
        return results

    def _code_components(self, samples: list[Sample]) -> Iterator[tuple[int, int, ComponentConfig]]:
        """(sample index, component position, component) of each component that is a code-contest rule."""
        return ((index, position, component) for index, position, component in self._components(samples)
                if component.rule in code_contests.CODE_RULES)

    def _components(self, samples: list[Sample]) -> Iterator[tuple[int, int, ComponentConfig]]:
        """(sample index, component position, component) of each component of each sample whose data source has
        a scorer (one without is reported when the sample itself is scored)."""
        for index, sample in enumerate(samples):
            try:
                components = self.components_for(sample.data_source)
            except ValueError:
                continue
            for position, component in enumerate(components):
                yield index, position, component

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
            values: Sequence[float | Exception]
            try:
                values = self.reward_models[path].score([samples[i].prompt + samples[i].response for i in indices])
            except Exception as error:  # noqa: BLE001 - the samples that needed it become invalid
                values = [error] * len(indices)
            scores.update({(path, i): v for i, v in zip(indices, values)})
        return scores

    def _score_one(self, index: int, sample: Sample, model_scores, *, judged) -> SampleResult:
        started = time.perf_counter()
        try:
            parts = [(component, self._component_score(component, index, position, model_scores=model_scores,
                                                       judged=judged))
                     for position, component in enumerate(self.components_for(sample.data_source))]
            acc = next((part.acc for _, part in parts if part.acc is not None), None)
            pred = next((part.pred for _, part in parts if part.pred), "")
            components = tuple((component.name, component.weight, part.value) for component, part in parts)
            seconds = time.perf_counter() - started + sum(part.seconds for _, part in parts)
            return SampleResult(score=sum(weight * value for _, weight, value in components), valid=True, error="",
                                seconds=seconds, acc=acc, pred=pred,
                                components=components, timed_out=any(part.timed_out for _, part in parts))
        except Exception as error:  # noqa: BLE001 - one bad sample must not fail the batch
            return SampleResult(score=0.0, valid=False, error=f"{type(error).__name__}: {error}",
                                seconds=time.perf_counter() - started,
                                timed_out=isinstance(error, TimeoutError))

    def _component_score(self, component: ComponentConfig, index: int, position: int, *, model_scores,
                         judged) -> ComponentScore:
        if component.reward_model:
            value = model_scores[(component.reward_model, index)]
            if isinstance(value, Exception):
                raise value
            return ComponentScore(value=value)
        result = judged[(index, position)]
        if component.rule and isinstance(result, TimeoutError):
            acc = False if component.rule in rules.ANSWERS else None  # a rule of form says nothing of answers
            return ComponentScore(value=rules.FAILURE_SCORE, acc=acc, timed_out=True,
                                  seconds=self.config.sample_timeout_s)
        if isinstance(result, Exception):
            raise result
        return ComponentScore(value=result.score, acc=result.acc, pred=result.pred, seconds=result.seconds)

    def close(self) -> None:
        for workers in [*self.functions.values(), self.rules]:
            workers.close()
        self._sandbox_runs.shutdown(wait=False, cancel_futures=True)
