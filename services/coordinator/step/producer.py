"""The generation side of a step: its batch of prompts generated over the run's rollouts and scored over its
reward services, as the pipeline asks for it (``Producer.produce``, step after step).

Choices:
- The prompts come from the run's sampler, in its order; sampling seeds from (trainer.seed, step, round), so a
  prompt's samples do not depend on which replica served it.
- DAPO dynamic sampling (algorithm.filter_groups): groups whose scores are all equal are dropped and further
  batches generated, up to filter_groups.max_num_gen_batches rounds, the kept prompts cut to the batch size.
- remax: one greedy response (temperature 0) to each prompt is generated and scored beside the samples, from the
  same weights, as every response's baseline.
- Without dynamic sampling a batch is handed over once generated, its scores still coming (``Produced.scoring``):
  the trainer's first calls (old and reference logprobs, values), which need no scores, run beside the reward
  services, and the scores are awaited where the advantages need them.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass

from services import algos
from services.common.timing import StageTimer
from services.coordinator.agent.agent_loop import AgentLoop
from services.coordinator.fleet.reward_set import RewardSet
from services.coordinator.fleet.rollout_set import RolloutSet
from services.coordinator.settings import LoopSettings
from services.coordinator.step import generation
from services.coordinator.step.generation import Rollouts
from services.coordinator.step.metrics import rollout_balance
from services.coordinator.step.sampler import PromptSampler
from services.coordinator.waiting import Notices
from services.run.data import Prompt


@dataclass(frozen=True, kw_only=True)
class Produced:
    """A step's scored batch, as the generation side hands it to the training side."""

    rollouts: Rollouts  # scored, unless ``scoring`` is set
    metrics: dict[str, float]  # of the generation: filtering, samples per replica (and, once scored, per reward)
    seconds: dict[str, float]  # stage -> seconds spent generating and scoring it (reward: once scored)
    scoring: asyncio.Future[Rollouts] | None = None  # the rollouts scored, still coming (None: they are)

    async def scored(self) -> Rollouts:
        """The rollouts with their scores (waiting for them); ``metrics`` and ``seconds`` then hold the scoring's."""
        return self.rollouts if self.scoring is None else await self.scoring


class Producer:
    """A run's batches, step by step: what the pipeline calls to generate (and score) the batch of a step."""

    def __init__(self, *, settings: LoopSettings, prompts: list[Prompt], sampler: PromptSampler,
                 rollout_set: RolloutSet, reward_set: RewardSet, agent: AgentLoop | None, tokenizer,
                 notices: Notices):
        """``agent``: a multi-turn run's agent loop (None: one response per prompt); ``tokenizer``: the model's, to
        decode responses for the reward services."""
        self.settings, self.prompts, self.sampler = settings, prompts, sampler
        self.rollout_set, self.reward_set, self.agent = rollout_set, reward_set, agent
        self.tokenizer, self.notices, self.timeout_s = tokenizer, notices, settings.rpc_timeout_s
        self._scoring: set[asyncio.Task[Rollouts]] = set()  # the scoring of batches handed over before their scores

    async def produce(self, step: int) -> Produced:
        """The generation side of a step: its batch generated and scored (from weights no older than those the
        rollouts serve now). With DAPO dynamic sampling, groups whose scores are all equal are dropped and
        further batches generated, up to filter_groups.max_num_gen_batches rounds."""
        timer, oldest = StageTimer(), self.rollout_set.served
        counts: dict[str, float] = {}
        if not self.settings.filter_groups:
            generated = await self.generate_round(step, 0, timer, counts=counts, oldest=oldest)
            scoring = asyncio.ensure_future(self.score_round(step, generated, timer, counts=counts))
            self._scoring.add(scoring)
            scoring.add_done_callback(self._scoring.discard)
            return Produced(rollouts=generated, metrics=counts, seconds=timer.seconds, scoring=scoring)
        wanted, kept = self.settings.batch_size, []
        for round_index in range(self.settings.max_gen_rounds):
            rollouts = await self.generate_and_score(step, round_index, timer, counts=counts, oldest=oldest)
            signal = algos.groups_with_signal(rollouts.scores, rollouts.group_ids)
            kept.append(rollouts.keep_prompts(rollouts.prompts_where_every_sample(signal)))
            if sum(len(part.prompts) for part in kept) >= wanted:
                break
        merged = Rollouts.concat(kept) if any(part.prompts for part in kept) else rollouts
        merged = merged.keep_prompts(list(range(min(wanted, len(merged.prompts)))))
        return Produced(rollouts=merged, metrics={**counts,
                                                  "training/filter_groups/kept_prompts": float(len(merged.prompts)),
                                                  "training/filter_groups/gen_rounds": float(round_index + 1)},
                        seconds=timer.seconds)

    async def close(self) -> None:
        """Stop scoring the batches handed over that no step will train on (a run stopped or failed early)."""
        for scoring in self._scoring:
            scoring.cancel()
        await asyncio.gather(*self._scoring, return_exceptions=True)

    async def generate_and_score(self, step: int, round_index: int, timer: StageTimer, *, counts: dict[str, float],
                                 oldest: int) -> Rollouts:
        """One round: the next batch's responses, sampled from weight versions >= ``oldest``, and their scores;
        ``counts`` gets the samples each replica produced, and each one's share and speed (of the rounds so far),
        and each reward replica's."""
        generated = await self.generate_round(step, round_index, timer, counts=counts, oldest=oldest)
        return await self.score_round(step, generated, timer, counts=counts)

    async def generate_round(self, step: int, round_index: int, timer: StageTimer, *, counts: dict[str, float],
                             oldest: int) -> Rollouts:
        """A round's responses, not yet scored (remax's greedy baselines: generated and scored); ``counts`` gets the
        samples each replica produced, and each one's share and speed (of the rounds so far)."""
        chosen = [self.prompts[i] for i in self.sampler.next_batch()]
        seed = (self.settings.seed * 1_000_003 + step) * 101 + round_index
        with timer("gen"):
            if self.agent is None:
                rollouts, by_rollout = await generation.generate(self.rollout_set, chosen, self.settings.sampling,
                                                                 seed=seed, oldest=oldest, timeout_s=self.timeout_s,
                                                                 notices=self.notices, what=f"step {step}")
            else:
                rollouts, by_rollout, trajectories = await generation.generate_trajectories(
                    self.agent, chosen, self.settings.sampling, seed=seed, oldest=oldest, timeout_s=self.timeout_s,
                    what=f"step {step}")
                counts |= trajectories
        if self.settings.estimator.greedy_baseline:
            rollouts = await self.with_greedy_baselines(rollouts, chosen, seed, oldest=oldest, step=step, timer=timer)
        for address, count in by_rollout.items():
            add_count(counts, f"rollout/samples_by/{address}", count)
        counts |= rollout_balance(counts, self.rollout_set.speeds.speeds)
        return rollouts

    async def score_round(self, step: int, rollouts: Rollouts, timer: StageTimer, *,
                          counts: dict[str, float]) -> Rollouts:
        """A round's responses scored; ``counts`` gets the samples each reward replica scored."""
        with timer("reward"):
            scoring = await generation.score(self.reward_set, rollouts, self.tokenizer, notices=self.notices,
                                             what=f"step {step}")
        for service_id, count in scoring.by_service.items():
            add_count(counts, f"reward/samples_by/{service_id}", count)
        add_count(counts, "reward/timeouts", sum(s.timed_out for s in scoring.scores))
        return scoring.rollouts

    async def with_greedy_baselines(self, rollouts: Rollouts, chosen: list[Prompt], seed: int, *, oldest: int,
                                    step: int,
                                    timer: StageTimer) -> Rollouts:
        """``rollouts`` with the score of one greedy response (temperature 0) to each prompt, from the same weights,
        as every response's baseline (remax; verl's timing_s/gen_max)."""
        greedy_sampling = dataclasses.replace(self.settings.sampling, n=1, temperature=0.0, top_p=1.0)
        with timer("gen_max"):
            greedy, _ = await generation.generate(self.rollout_set, chosen, greedy_sampling, seed=seed, oldest=oldest,
                                                  timeout_s=self.timeout_s, notices=self.notices,
                                                  what=f"step {step} greedy baselines")
            scored = await generation.score(self.reward_set, greedy, self.tokenizer, notices=self.notices,
                                            what=f"step {step} greedy baselines")
        return dataclasses.replace(rollouts, baselines=scored.rollouts.scores[rollouts.group_ids])


def add_count(counts: dict[str, float], name: str, count: int) -> None:
    counts[name] = counts.get(name, 0.0) + float(count)
