"""Settings of a reward service process: what it scores with, and its limits."""

from __future__ import annotations

import pydantic
from pydantic import Field, PositiveFloat, PositiveInt

from services.common.config import Section, ServeConfig
from services.common.sandbox import SandboxLimits


class ComponentConfig(Section):
    """One part of a data_source's score: a built-in rule or a user's function, and its weight."""

    rule: str | None = None
    """Name of a built-in rule (services/reward/rules.py SCORERS: openai/gsm8k, lighteval/MATH, ...), or a
    code-contest rule (services/reward/code_contests.py: codecontests, apps, codeforces, taco), which runs the
    response's program in the code sandbox."""
    function: str | None = None
    """A user's function with verl's signature: path/to/file.py:name or package.module:name."""
    reward_model: str | None = None
    """A local AutoModelForSequenceClassification folder (one output) scoring prompt + response."""
    options: dict[str, str | float | int | bool] = {}
    """Keyword options of a rule, e.g. for openai/gsm8k: method (strict or flexible), format_score; for a
    code-contest rule: max_cases (the first cases scored, 10) and all_or_nothing (1 only when all pass, false)."""
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


class SandboxConfig(Section):
    """Limits of each test-case run of the code-contest rules, in the code sandbox (services/common/sandbox.py)."""

    wall_s: PositiveFloat = 10.0
    """Wall-clock seconds one case may run (verl's per-case timeout); past them every process of its sandbox is
    killed and the case fails (T)."""
    cpu_s: PositiveFloat = 10.0
    """CPU seconds per process of a case, rounded up to whole seconds; past them it is stopped and the case fails
    (T)."""
    memory_mb: PositiveInt = 1024
    """Address space per process of a case, in MiB (verl's sandbox default); an allocation past it fails (M)."""
    processes: PositiveInt = 16
    """Processes and threads a case's program may have at once; a fork past them fails inside the program."""
    output_bytes: PositiveInt = 1 << 20
    """Bytes of stdout (and of stderr) kept; a program printing more is stopped and its case fails (O)."""
    tmp_mb: PositiveInt = 64
    """Size of the writable /tmp a case's program sees (it holds the program), in MiB."""
    concurrent_runs: PositiveInt = Field(4, le=64)
    """Cases run at once by this service, each in a sandbox of its own (a host has 64 sandbox uids, shared with
    its env services); the others wait their turn."""

    def limits(self) -> SandboxLimits:
        return SandboxLimits(cpu_s=self.cpu_s, wall_s=self.wall_s, memory_mb=self.memory_mb,
                             processes=self.processes, output_bytes=self.output_bytes, tmp_mb=self.tmp_mb)


class RewardServiceConfig(ServeConfig):
    scorers: dict[str, list[ComponentConfig]] = {}
    """Per data_source, the components whose weighted sum is the score."""
    default: list[ComponentConfig] | None = None
    """Components for a data_source not in scorers (null: the built-in rule of that name, else an error)."""
    sample_timeout_s: PositiveFloat = 10.0
    """Longest a rule or a user function may take on one sample; past it its worker is replaced, and the sample
    scores the rule's failure value (0), or is invalid (a user function). Code-contest rules are bounded by
    sandbox.wall_s per case instead."""
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
    sandbox: SandboxConfig = SandboxConfig()
    """Limits of the code-contest rules' test-case runs."""

    def compute_devices(self) -> tuple[str, ...]:
        return (self.device,)

    def computes_with_torch(self) -> bool:
        """A reward model runs in this process; rules and users' functions run in worker processes it spawns."""
        return any(component.reward_model for group in [*self.scorers.values(), self.default or []]
                   for component in group)
