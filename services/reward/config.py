"""Settings of a reward service process: what it scores with, and its limits."""

from __future__ import annotations

import pydantic
from pydantic import Field, PositiveFloat, PositiveInt

from services.common.config import Section, ServeConfig


class ComponentConfig(Section):
    """One part of a data_source's score: a built-in rule or a user's function, and its weight."""

    rule: str | None = None
    """Name of a built-in rule (services/reward/rules.py SCORERS): openai/gsm8k, lighteval/MATH, ..."""
    function: str | None = None
    """A user's function with verl's signature: path/to/file.py:name or package.module:name."""
    reward_model: str | None = None
    """A local AutoModelForSequenceClassification folder (one output) scoring prompt + response."""
    options: dict[str, str | float | int | bool] = {}
    """Keyword options of a rule, e.g. for openai/gsm8k: method (strict or flexible), format_score."""
    weight: float = 1.0
    """Factor of this component's value in its data_source's score, the weighted sum of the components. A
    component that fails makes the sample invalid, scored 0."""

    @pydantic.model_validator(mode="after")
    def _one_kind(self) -> ComponentConfig:
        if sum(x is not None for x in (self.rule, self.function, self.reward_model)) != 1:
            raise ValueError("a scorer component names exactly one of rule, function or reward_model")
        if self.options and not self.rule:
            raise ValueError("options are for rules only")
        return self

    @property
    def name(self) -> str:
        return self.rule or self.function or self.reward_model  # type: ignore[return-value]  # one is set (_one_kind)


class RewardServiceConfig(ServeConfig):
    scorers: dict[str, list[ComponentConfig]] = {}
    """Per data_source, the components whose weighted sum is the score."""
    default: list[ComponentConfig] | None = None
    """Components for a data_source not in scorers (null: the built-in rule of that name, else an error)."""
    sample_timeout_s: PositiveFloat = 10.0
    """Longest a rule or a user function may take on one sample; past it its worker is replaced, and the sample
    scores the rule's failure value (0), or is invalid (a user function)."""
    function_workers: PositiveInt = Field(2, le=64)
    """Worker processes per user function, and for the built-in rules."""
    max_concurrent_batches: PositiveInt = 4
    """Score calls served at once; more wait their turn."""
    score_threads: PositiveInt = 4
    """Slices of a batch scored at once (each user-function sample holds a worker process)."""
    device: str = "cpu"
    """torch device of reward models."""
    reward_model_batch_size: PositiveInt = 32
    """Sequences per reward-model forward pass."""

    def compute_devices(self) -> tuple[str, ...]:
        return (self.device,)
