"""What a reward service scores with: per data_source, a weighted sum of components.

A component is a built-in rule (``services/reward/rules.py``) or a user's
function (``services/reward/plugins.py``). A data_source the config does
not name uses ``default`` when given, else the built-in rule registered
under the data_source's own name. Each sample is scored on its own: an error
or a timeout in any of its components marks that sample invalid (score 0,
with the error), and the rest of the batch is unaffected.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from services.reward import rules
from services.reward.config import ComponentConfig, RewardServiceConfig
from services.reward.plugins import FunctionWorkers


@dataclass(frozen=True)
class SampleResult:
    score: float
    valid: bool
    error: str
    seconds: float


class Scorer:
    def __init__(self, config: RewardServiceConfig):
        self.config = config
        refs = {c.function for components in [*config.scorers.values(), config.default or []] for c in components
                if c.function}
        self.functions = {ref: FunctionWorkers(ref, config.function_workers, config.sample_timeout_s)
                          for ref in sorted(refs)}
        for components in [*config.scorers.values(), config.default or []]:
            for component in components:
                if component.rule and component.rule not in rules.SCORERS:
                    raise ValueError(f"unknown rule {component.rule!r}; known: {sorted(rules.SCORERS)}")

    def components_for(self, data_source: str) -> list[ComponentConfig]:
        if data_source in self.config.scorers:
            return self.config.scorers[data_source]
        if self.config.default:
            return self.config.default
        if data_source in rules.SCORERS:
            return [ComponentConfig(rule=data_source)]
        raise ValueError(f"no scorer for data_source {data_source!r}; configured: {sorted(self.config.scorers)}, "
                         f"built-in rules: {sorted(rules.SCORERS)}")

    def score(self, data_source: str, response: str, ground_truth: str, extra_info: dict) -> SampleResult:
        """Blocking: one sample's weighted score, or an invalid result with the error."""
        started = time.perf_counter()
        try:
            total = 0.0
            for component in self.components_for(data_source):
                if component.function:
                    value = self.functions[component.function].score(data_source, response, ground_truth, extra_info)
                else:
                    value = rules.SCORERS[component.rule](response, ground_truth)
                total += component.weight * value
            return SampleResult(total, True, "", time.perf_counter() - started)
        except Exception as error:  # noqa: BLE001 - one bad sample must not fail the batch
            return SampleResult(0.0, False, f"{type(error).__name__}: {error}", time.perf_counter() - started)

    def close(self) -> None:
        for workers in self.functions.values():
            workers.close()
