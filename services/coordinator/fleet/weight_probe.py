"""The weight check after every sync: the bucket checksums prove the bytes arrived, this proves the engine computes
with them.

- The probe (``draw_probe``): a few sequences of the first batch a run trains, one sample each of the first prompts
  with a response: the training prompt and the model's own continuation. Drawn once, kept for every later sync,
  and in each checkpoint (``state``, ``restore``), so a resumed run checks with the same probe.
- After each sync every rollout scores the probe (``RolloutClient.compute_log_probs``: each response token's logprob
  given what comes before it, at temperature 1, under the weights it now serves, and their version, and at each of
  those positions its top_k most likely next tokens with their logprobs: its whole next-token distribution, as far
  as it matters). The rollouts of a sync are asked at once, concurrently; a rollout takes the call beside the
  generation it may have in flight (generating ahead), not after it (the hf engine between two token steps, vLLM
  beside its running requests). The actor, holding the same version, is asked at the same time, at temperature 1,
  for the same tokens' logprobs and, at each position, its own ``TRAINER_TOP_FACTOR`` times top_k most likely
  next tokens (``WeightProbe.check``); its answer is kept for the version, so a re-check after a re-sync does not
  ask again. Each rollout's top-k ids are read there (``logprobs_at``); only where one of them lies outside the
  actor's top (a rollout whose distribution is off, or a near tie at the edge) is the actor asked, after the
  rollouts answered, for exactly those ids (ComputeLogProbs candidate_ids). Either way the KL is of the same
  numbers: the actor's logprob of each id as one forward computes it. So the check costs a forward of the probe
  on each side, side by side, whatever the staleness or the batch size (bench/weight_probe_cost.py).
- A rollout passes where the mean and the largest |rollout - trainer logprob| over the probe's response tokens
  (``algos.logprob_diff``) are within the tolerance of its engine and dtype, and so is the mean over those
  positions of KL(rollout || trainer) over the rollout's top-k tokens and the rest of the vocabulary as one bucket
  (``algos.topk_kl``: a lower bound of the whole vocabulary's KL, from the top-k alone). The tolerances are
  ``tolerance_for``'s: the run's actor_rollout_ref.rollout.weight_check keys, else ``MEASURED``. The sampled
  tokens' logprobs alone miss a rollout whose distribution moved where the probe's tokens are not; the KL sees
  every likely token. What a rollout that fails meets is the rollout set's to decide (``RolloutSet.sync``: the
  weights once more, then out of the run).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from dataclasses import dataclass
from typing import NamedTuple

import torch

from services import algos
from services.common.sequences import SequenceBatch, split_ragged
from services.coordinator.fleet.clients import RolloutClient, RolloutScores, TrainerClient, TrainerTop
from services.coordinator.settings import WeightCheckSettings
from services.coordinator.waiting import describe


class WeightCheckFailed(RuntimeError):
    """No rollout of the run passed the weight check, twice: the run fails, naming the figures."""


class Tolerance(NamedTuple):
    """The most a rollout's probe may differ from the trainer's: the mean |delta logprob| of its tokens, any one
    token's, and the mean top-k KL of its next-token distributions (``algos.topk_kl``)."""

    mean: float
    max: float
    topk_kl: float


# Tolerances by (rollout engine, model dtype). Measured on CPU (hf against the CPU trainer, the local default's
# 128-wide 2-layer model, 3 runs of 6 steps): float32 mean 1.1e-7 to 1.8e-7, max 2.7e-7 to 9.5e-7; bfloat16
# (both sides the same CPU kernels) mean 1.2e-7 to 1.6e-7, max 2.9e-7 to 4.4e-7. The float32 tolerance leaves
# about 55 times room on the mean and 100 on the max; a shift of 0.5 on the final norm shows mean 0.05, max 0.14
# (tests/integration/test_weight_probe.py).
#
# The top-k KL (``algos.topk_kl``, k = 20), measured 2026-12-07 on this 2-core CPU:
# - hf fp32 against the CPU trainer: 0 at every sync, bit for bit (the |delta logprob| 0 too), on the tiny dense
#   model and on the tiny Qwen3-MoE with routing replay on and off, its trainer under FSDP2
#   (tests/integration/test_weight_probe.py, test_moe_run.py); wrong weights after the checksums: the final norm
#   shifted by 0.5, mean 2.1e-3 (max 3.3e-3); one expert's up_proj shifted, mean 2.3e-4 (max 1.1e-3). The
#   tolerance, 1e-6, sits 230 times below the smaller.
# - bf16 arithmetic (bench/probe_kl.py: the random-init models of tests/gpu/test_moe_vllm.py scored in bf16 against
#   the same weights in fp32, hf on the CPU, 3 seeds x 384 positions): dense mean 1.52e-3 to 1.58e-3 (max 2.1e-2
#   at one position); the Qwen3-MoE with each side's own routes mean 2.0e-2 to 4.1e-2 (max 2.0 where a token's
#   experts flip), with the fp32 side's routes replayed on the bf16 side 1.3e-3 to 1.5e-3 (max 2.7e-2). Routing
#   flips make ten to thirty times the KL of the arithmetic; the probe routes each side by its own routers (with
#   or without R3 in the run), so a mixture of experts has a tolerance of its own (``MOE_TOPK_KL``). These are an
#   upper bound of a GPU's bf16 against a bf16 trainer: the same comparison's |delta logprob| (0.06 dense) is six
#   times the dense probe's on an H200 (0.009). Dense bf16: 1e-2, about 6 times the CPU's bf16-against-fp32
#   mean; MoE bf16: 0.15, about 4 times the largest own-routes mean (as the logprob mean's room over the MoE's).
#   tests/gpu/test_moe_vllm.py and test_weight_probe_vllm.py print the GPU's figures.
# - vLLM fp32 and fp16: not measured; set from their |delta logprob| (a KL is of the order of the square of a
#   logit's difference: 1e-3 gives about 1e-6), a hundred times over that.
KL_HF_FP32 = 1e-6
KL_BF16 = 1e-2
MEASURED: dict[tuple[str, str], Tolerance] = {
    ("hf", "float32"): Tolerance(mean=1e-5, max=1e-4, topk_kl=KL_HF_FP32),
    # bf16 on a GPU: set from the rollout/trainer |delta logprob| measured on an H200 (bench/results/
    # gpu-tests-2026-12-05-b.md): a dense random-init 0.5B with a LoRA adapter, 0.012 mean on its samples; a
    # random-init Qwen3-MoE, 0.067 mean and 0.30 max on one step's samples, and single tokens up to 11 where a
    # token's expert choice flips between the two kernels. So the mean decides, with about 4 times room over the
    # MoE's, and the max only catches the absurd: a probe of 4 sequences may hold a flipped token, and a healthy
    # rollout must never be dropped for it. The probe itself on vLLM bf16 (dense random-init 0.5B, 4 syncs, H200,
    # bench/results/gpu-tests-2026-12-05-c.md): mean 0.0090 to 0.0095, max 0.031 to 0.043.
    ("hf", "bfloat16"): Tolerance(mean=0.25, max=16.0, topk_kl=KL_BF16),
    ("hf", "float16"): Tolerance(mean=0.25, max=16.0, topk_kl=KL_BF16),
    ("vllm", "bfloat16"): Tolerance(mean=0.25, max=16.0, topk_kl=KL_BF16),
    ("vllm", "float16"): Tolerance(mean=0.02, max=0.5, topk_kl=1e-3),
    # vLLM fp32 on an H200 against the trainer's fp32 (the 128-wide chat model of examples/gpu_tools.yaml, 100
    # syncs, bench/results/gpu-tests-2026-12-05-c.md): mean 7.9e-4 to 1.4e-3, max 0.0092 to 0.041 (GPU kernels
    # differ from the trainer's in summation order); the first tolerance here, 1e-3 and 1e-2, failed a healthy
    # rollout at its first sync. About 7 times room on the mean and 6 on the max.
    ("vllm", "float32"): Tolerance(mean=1e-2, max=0.25, topk_kl=1e-4),
}
MOE_TOPK_KL: dict[str, float] = {"bfloat16": 0.15, "float16": 0.15}
"""The top-k KL tolerance of a mixture of experts by dtype, where it differs from a dense model's (above)."""


def tolerance_for(engine: str, dtype: str, settings: WeightCheckSettings) -> Tolerance:
    """A rollout's tolerance: the run's tolerance_mean, tolerance_max and tolerance_topk_kl where set, else the
    figures ``MEASURED`` for its engine and the model's dtype (an engine or dtype without one: bf16 vLLM's, the
    widest), a mixture of experts' top-k KL from ``MOE_TOPK_KL``."""
    measured = MEASURED.get((engine, dtype), MEASURED[("vllm", "bfloat16")])
    topk_kl = MOE_TOPK_KL.get(dtype, measured.topk_kl) if settings.mixture_of_experts else measured.topk_kl
    return Tolerance(mean=settings.tolerance_mean or measured.mean, max=settings.tolerance_max or measured.max,
                     topk_kl=settings.tolerance_topk_kl or topk_kl)


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


TRAINER_TOP_FACTOR = 4  # the actor's top tokens asked for beside the rollouts: this many times their top_k


def logprobs_at(ids: torch.Tensor, top_ids: torch.Tensor, top_logprobs: torch.Tensor) -> torch.Tensor | None:
    """The logprobs of ``ids`` read from a distribution's most likely tokens at the same positions (``top_ids``,
    ``top_logprobs``, each row's ids distinct); None unless every one of ``ids`` is among them there.
    [T, k] int64, [T, K] int64, [T, K] -> [T, k]."""
    if ids.shape[0] != top_ids.shape[0]:
        raise ValueError(f"ids at {ids.shape[0]} positions, the top tokens at {top_ids.shape[0]}")
    found = ids.unsqueeze(-1) == top_ids.unsqueeze(-2)  # [T, k, K]
    if not bool(found.any(dim=-1).all()):
        return None
    return top_logprobs.gather(1, found.int().argmax(dim=-1))


UNSCORED = algos.LogprobDiff(math.inf, math.inf)
UNCOMPARED = algos.DistributionDiff(math.inf, math.inf)


@dataclass(frozen=True, kw_only=True)
class ProbeResult:
    """One rollout's probe after a sync."""

    address: str
    version: int  # of the weights it was to serve
    diff: algos.LogprobDiff  # its logprobs against the trainer's (infinite where it could not score)
    kl: algos.DistributionDiff  # its top-k next-token distributions against the trainer's (``algos.topk_kl``)
    tolerance: Tolerance
    error: str = ""  # why it could not score the probe, if it could not
    seconds: float = 0.0  # from asking the rollout to its answer (or failure)
    asked_ids: bool = False  # one of its top-k ids lay outside the actor's top: the actor was asked for its ids

    @property
    def passed(self) -> bool:
        return (self.diff.mean <= self.tolerance.mean and self.diff.max <= self.tolerance.max
                and self.kl.mean <= self.tolerance.topk_kl)

    def described(self) -> str:
        """For an event: the version and, against the tolerance, the mean and max |delta logprob| and top-k KL."""
        if self.error:
            return f"it could not score the weight probe of version {self.version} ({self.error[:300]})"
        return (f"its weight probe of version {self.version}: mean |delta logprob| {self.diff.mean:.3g}, max "
                f"{self.diff.max:.3g}; tolerance {self.tolerance.mean:.3g} mean, {self.tolerance.max:.3g} max; "
                f"top-k KL mean {self.kl.mean:.3g}, max {self.kl.max:.3g}; tolerance {self.tolerance.topk_kl:.3g} "
                "mean")


class WeightProbe:
    """The probe of one run attempt, scored by the rollouts and the actor after each sync."""

    def __init__(self, settings: WeightCheckSettings, dtype: str, actor: TrainerClient, *, timeout_s: float):
        self.settings, self.dtype, self.actor, self.timeout_s = settings, dtype, actor, timeout_s
        self.sequences: SequenceBatch | None = None  # None until drawn
        self._trainer_top: tuple[int, asyncio.Future[TrainerTop]] | None = None  # the actor's answer, by version

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
        self._trainer_top = None

    async def check(self, members: list[RolloutClient], engines: dict[str, str],
                    version: int) -> list[ProbeResult]:
        """Each member's probe against the actor's, the actor holding ``version`` (``engines``: each member's
        engine, by address, for its tolerance); none before the probe is drawn. The members and the actor are
        asked at once (the actor's answer kept for ``version``); the actor again, for their ids, only for the
        members with a top-k id outside its top."""
        if self.sequences is None or not members:
            return []
        trainer = self._trainer_answer(self.sequences, version)
        answers = await asyncio.gather(*(self._scored(member, self.sequences) for member in members))
        top = await trainer
        scored = {index: answer for index, (answer, _) in enumerate(answers)
                  if isinstance(answer, RolloutScores) and answer.version == version}
        in_top = {index: logprobs_at(top_of(answer)[0], top.top_ids, top.top_logprobs)
                  for index, answer in scored.items()}
        outside = [index for index, found in in_top.items() if found is None]
        asked = dict(zip(outside, await self._actor_at(self.sequences, [scored[i] for i in outside]))) if (
            outside) else {}
        results = []
        for index, (member, (answer, seconds)) in enumerate(zip(members, answers)):
            tolerance = tolerance_for(engines.get(member.address, ""), self.dtype, self.settings)
            result = ProbeResult(address=member.address, version=version, diff=UNSCORED, kl=UNCOMPARED,
                                 tolerance=tolerance, seconds=seconds, asked_ids=index in outside)
            if isinstance(answer, BaseException):
                result = dataclasses.replace(result, error=describe(answer))
            elif answer.version != version:
                result = dataclasses.replace(result, error=f"it serves weight version {answer.version}")
            else:
                trainer_at_top = in_top[index]
                if trainer_at_top is None:
                    trainer_at_top = asked[index]
                result = dataclasses.replace(
                    result, diff=algos.logprob_diff(answer.logprobs, top.logprobs),
                    kl=algos.distribution_diff(algos.topk_kl(top_of(answer)[1], trainer_at_top)))
            results.append(result)
        return results

    def _trainer_answer(self, sequences: SequenceBatch, version: int) -> asyncio.Future[TrainerTop]:
        """The actor's logprobs of the probe's tokens and its TRAINER_TOP_FACTOR * top_k most likely next tokens at
        each position, at temperature 1: asked now, or the answer (or call in flight) of ``version`` kept from an
        earlier check (a call that failed is asked again)."""
        kept = self._trainer_top
        if kept is None or kept[0] != version or (kept[1].done() and (kept[1].cancelled()
                                                                     or kept[1].exception() is not None)):
            asked = asyncio.ensure_future(self.actor.compute_top_log_probs(
                sequences, self.settings.top_k * TRAINER_TOP_FACTOR, timeout=self.timeout_s, temperature=1.0))
            kept = self._trainer_top = (version, asked)
        return kept[1]

    async def _actor_at(self, sequences: SequenceBatch, scored: list[RolloutScores]) -> list[torch.Tensor]:
        """The actor's logprobs, for each of ``scored``, of its top-k ids at each position ([T, k] each), at
        temperature 1, in one call."""
        top_ids = [top_of(answer)[0] for answer in scored]
        _, at_candidates = await self.actor.compute_candidate_log_probs(
            sequences, torch.cat(top_ids, dim=1), timeout=self.timeout_s, temperature=1.0)
        return list(torch.split(at_candidates, [ids.shape[1] for ids in top_ids], dim=1))

    async def _scored(self, member: RolloutClient,
                      sequences: SequenceBatch) -> tuple[RolloutScores | BaseException, float]:
        """A member's scores of the probe, or what it failed with, and the seconds it took."""
        started = time.perf_counter()
        try:
            answer: RolloutScores | BaseException = await member.compute_log_probs(
                sequences, self.timeout_s, top_k=self.settings.top_k)
        except Exception as error:  # noqa: BLE001 - it fails the member's check, naming the error
            answer = error
        return answer, time.perf_counter() - started


def top_of(answer: RolloutScores) -> tuple[torch.Tensor, torch.Tensor]:
    """A rollout's top-k ids and logprobs of the probe ([T, k] each; it was asked for them)."""
    if answer.top_ids is None or answer.top_logprobs is None:
        raise ValueError("the rollout returned no top-k tokens for the weight probe")
    return answer.top_ids, answer.top_logprobs
