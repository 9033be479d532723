"""The weight check after every sync: the bucket checksums prove the bytes arrived, this proves the engine computes
with them.

- The probe (``draw_probe``): a few sequences of the first batch a run trains, one sample each of the first prompts
  with a response: the training prompt and the model's own continuation. Drawn once, kept for every later sync,
  and in each checkpoint (``state``, ``restore``), so a resumed run checks with the same probe.
- After each sync every rollout scores the probe (``RolloutClient.compute_log_probs``: each response token's logprob
  given what comes before it, at temperature 1, under the weights it now serves, and their version) and the
  actor's logprobs of the same tokens and version, computed once per version at temperature 1, are the reference
  (``WeightProbe.check``). The rollouts of a sync and the actor are asked at once, concurrently; a rollout takes
  the call beside the generation it may have in flight (generating ahead), not after it (the hf engine between two
  token steps, vLLM beside its running requests), so the check costs a few forwards of the probe, whatever the
  staleness or the batch size (bench/weight_probe_cost.py).
- A rollout passes where the mean and the largest |rollout - trainer logprob| over the probe's response tokens
  (``algos.logprob_diff``) are within the tolerance of its engine and dtype (``tolerance_for``: the run's
  actor_rollout_ref.rollout.weight_check keys, else ``MEASURED``). What a rollout that fails meets is the rollout
  set's to decide (``RolloutSet.sync``: the weights once more, then out of the run).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass
from typing import NamedTuple

import torch

from services import algos
from services.common.sequences import SequenceBatch, split_ragged
from services.coordinator.fleet.clients import RolloutClient, TrainerClient
from services.coordinator.settings import WeightCheckSettings
from services.coordinator.waiting import describe


class WeightCheckFailed(RuntimeError):
    """No rollout of the run passed the weight check, twice: the run fails, naming the figures."""


class Tolerance(NamedTuple):
    """The most a rollout's probe logprobs may differ from the trainer's: their mean |delta| and any one token's."""

    mean: float
    max: float


# Tolerances by (rollout engine, model dtype). Measured on CPU (hf against the CPU trainer, the local default's
# 128-wide 2-layer model, 3 runs of 6 steps): float32 mean 1.1e-7 to 1.8e-7, max 2.7e-7 to 9.5e-7; bfloat16
# (both sides the same CPU kernels) mean 1.2e-7 to 1.6e-7, max 2.9e-7 to 4.4e-7. The float32 tolerance leaves
# about 55 times room on the mean and 100 on the max; a shift of 0.5 on the final norm shows mean 0.05, max 0.14
# (tests/integration/test_weight_probe.py).
MEASURED: dict[tuple[str, str], Tolerance] = {
    ("hf", "float32"): Tolerance(mean=1e-5, max=1e-4),
    # bf16 on a GPU: set from the rollout/trainer |delta logprob| measured on an H200 (bench/results/
    # gpu-tests-2026-12-05-b.md): a dense random-init 0.5B with a LoRA adapter, 0.012 mean on its samples; a
    # random-init Qwen3-MoE, 0.067 mean and 0.30 max on one step's samples, and single tokens up to 11 where a
    # token's expert choice flips between the two kernels. So the mean decides, with about 4 times room over the
    # MoE's, and the max only catches the absurd: a probe of 4 sequences may hold a flipped token, and a healthy
    # rollout must never be dropped for it. The probe itself on vLLM bf16 (dense random-init 0.5B, 4 syncs, H200,
    # bench/results/gpu-tests-2026-12-05-c.md): mean 0.0090 to 0.0095, max 0.031 to 0.043.
    ("hf", "bfloat16"): Tolerance(mean=0.25, max=16.0),
    ("hf", "float16"): Tolerance(mean=0.25, max=16.0),
    ("vllm", "bfloat16"): Tolerance(mean=0.25, max=16.0),
    ("vllm", "float16"): Tolerance(mean=0.02, max=0.5),
    # vLLM fp32 on an H200 against the trainer's fp32 (the 128-wide chat model of examples/gpu_tools.yaml, 100
    # syncs, bench/results/gpu-tests-2026-12-05-c.md): mean 7.9e-4 to 1.4e-3, max 0.0092 to 0.041 (GPU kernels
    # differ from the trainer's in summation order); the first tolerance here, 1e-3 and 1e-2, failed a healthy
    # rollout at its first sync. About 7 times room on the mean and 6 on the max.
    ("vllm", "float32"): Tolerance(mean=1e-2, max=0.25),
}


def tolerance_for(engine: str, dtype: str, settings: WeightCheckSettings) -> Tolerance:
    """A rollout's tolerance: the run's tolerance_mean and tolerance_max where set, else the figures ``MEASURED`` for
    its engine and the model's dtype (an engine or dtype without one: bf16 vLLM's, the widest)."""
    measured = MEASURED.get((engine, dtype), MEASURED[("vllm", "bfloat16")])
    return Tolerance(mean=settings.tolerance_mean or measured.mean, max=settings.tolerance_max or measured.max)


def draw_probe(batch: SequenceBatch, group_ids: torch.Tensor, size: int) -> SequenceBatch | None:
    """The probe: the first sample with a response of each of the first ``size`` prompts that have one
    (``group_ids``: the prompt of each sample, in the batch's order; a multi-turn trajectory may hold several
    samples); None if no sample has a response. No loss mask: every response token is compared."""
    rows: list[int] = []
    prompts: set[int] = set()
    for row, (prompt, length) in enumerate(zip(group_ids.tolist(), batch.response_lens.tolist())):
        if length > 0 and prompt not in prompts and len(rows) < size:
            prompts.add(prompt)
            rows.append(row)
    if not rows:
        return None
    chosen = batch.select(torch.tensor(rows, dtype=torch.int64))
    return SequenceBatch(prompt_ids=chosen.prompt_ids, prompt_lens=chosen.prompt_lens,
                         response_ids=chosen.response_ids, response_lens=chosen.response_lens)


@dataclass(frozen=True, kw_only=True)
class ProbeResult:
    """One rollout's probe after a sync."""

    address: str
    version: int  # of the weights it was to serve
    diff: algos.LogprobDiff  # its logprobs against the trainer's (infinite where it could not score)
    tolerance: Tolerance
    error: str = ""  # why it could not score the probe, if it could not
    seconds: float = 0.0  # from asking the rollout to its answer (or failure)

    @property
    def passed(self) -> bool:
        return self.diff.mean <= self.tolerance.mean and self.diff.max <= self.tolerance.max

    def described(self) -> str:
        """For an event: the version and, against the tolerance, the mean and max |delta logprob|."""
        if self.error:
            return f"it could not score the weight probe of version {self.version} ({self.error[:300]})"
        return (f"its weight probe of version {self.version}: mean |delta logprob| {self.diff.mean:.3g}, max "
                f"{self.diff.max:.3g}; tolerance {self.tolerance.mean:.3g} mean, {self.tolerance.max:.3g} max")


class WeightProbe:
    """The probe of one run attempt and the actor's logprobs of it, one version at a time."""

    def __init__(self, settings: WeightCheckSettings, dtype: str, actor: TrainerClient, *, timeout_s: float):
        self.settings, self.dtype, self.actor, self.timeout_s = settings, dtype, actor, timeout_s
        self.sequences: SequenceBatch | None = None  # None until drawn
        self._expected: tuple[int, torch.Tensor] | None = None  # the actor's logprobs of the probe, and their version

    def draw(self, batch: SequenceBatch, group_ids: torch.Tensor) -> None:
        """Draw the probe from ``batch`` (``group_ids``: each sample's prompt) unless it is drawn."""
        if self.sequences is None:
            self.sequences = draw_probe(batch, group_ids, self.settings.sequences)

    def state(self) -> dict[str, list[list[int]]] | None:
        """The probe as a checkpoint keeps it (None: not drawn yet): its prompts and responses, as token ids."""
        if self.sequences is None:
            return None
        probe = self.sequences
        return {"prompts": [row.tolist() for row in split_ragged(probe.prompt_ids, probe.prompt_lens)],
                "responses": [row.tolist() for row in split_ragged(probe.response_ids, probe.response_lens)]}

    def restore(self, state: dict[str, list[list[int]]] | None) -> None:
        """Take the probe a checkpoint kept (``state``; None: it kept none, and the probe is drawn anew)."""
        if state is None:
            return
        self.sequences = SequenceBatch.of_lists(state["prompts"], state["responses"])

    async def check(self, members: list[RolloutClient], engines: dict[str, str],
                    version: int) -> list[ProbeResult]:
        """Each member's probe against the actor's, the actor holding ``version`` (``engines``: each member's
        engine, by address, for its tolerance); none before the probe is drawn."""
        if self.sequences is None or not members:
            return []
        scoring = asyncio.gather(*(self._scored(member, self.sequences) for member in members))
        expected, answers = await asyncio.gather(self._actor_logprobs(self.sequences, version), scoring)
        return [dataclasses.replace(
                    self._result(member.address, version, answer, expected=expected,
                                 tolerance=tolerance_for(engines.get(member.address, ""), self.dtype, self.settings)),
                    seconds=seconds)
                for member, (answer, seconds) in zip(members, answers)]

    async def _actor_logprobs(self, sequences: SequenceBatch, version: int) -> torch.Tensor:
        """The actor's logprobs of the probe at temperature 1, computed once per version."""
        if self._expected is None or self._expected[0] != version:
            logprobs = await self.actor.compute_log_probs(sequences, step=0, timeout=self.timeout_s, temperature=1.0)
            self._expected = version, logprobs
        return self._expected[1]

    async def _scored(self, member: RolloutClient,
                      sequences: SequenceBatch) -> tuple[tuple[int, torch.Tensor] | BaseException, float]:
        """A member's version and logprobs of the probe, or what it failed with (the actor's are computed beside),
        and the seconds it took."""
        started = time.perf_counter()
        try:
            answer: tuple[int, torch.Tensor] | BaseException = await member.compute_log_probs(sequences, self.timeout_s)
        except Exception as error:  # noqa: BLE001 - it fails the member's check, naming the error
            answer = error
        return answer, time.perf_counter() - started

    @staticmethod
    def _result(address: str, version: int, answer: tuple[int, torch.Tensor] | BaseException, *, expected: torch.Tensor,
                tolerance: Tolerance) -> ProbeResult:
        if isinstance(answer, BaseException):
            return ProbeResult(address=address, version=version, diff=algos.LogprobDiff(float("inf"), float("inf")),
                               tolerance=tolerance, error=describe(answer))
        served, logprobs = answer
        if served != version:
            return ProbeResult(address=address, version=version, diff=algos.LogprobDiff(float("inf"), float("inf")),
                               tolerance=tolerance, error=f"it serves weight version {served}")
        return ProbeResult(address=address, version=version, diff=algos.logprob_diff(logprobs, expected),
                           tolerance=tolerance)
