"""A batch generated over a run's rollouts and scored over its reward services: what a training step and a
validation both do.

- ``generate``: n responses per prompt, the prompts split into one shard per rollout replica, sized by the
  replica's measured speed (``RolloutSet.speeds``: response tokens per second of its Generate calls as timed
  here; a call that shared its replica with another, a shard redone there, counts slower) so that the
  replicas finish together; a shard whose replica fails, or comes back sampled from weights older than
  ``oldest``, is redone on another; if every replica fails, the rollouts are refreshed (waiting for one if
  none is left) and the whole batch generated again: same prompts, same seeds (from (seed, prompt index)),
  so nothing is lost or counted twice.
- ``generate_trajectories``: the same for a multi-turn run, each response a trajectory of the agent loop
  (services/coordinator/agent/agent_loop.py), with its loss mask and, in its lineage, its turns.
- ``score``: the responses decoded (on a worker thread: the event loop stays free for the calls in flight)
  and scored by the reward replicas (a trajectory: its final model turn, plus its environment's rewards).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from dataclasses import dataclass
from typing import NamedTuple

import torch

from services.common.errors import Unavailable
from services.coordinator.agent.agent_loop import AgentLoop, AgentTrace, Ended, agent_metrics, trajectory_batch
from services.common.sequences import SequenceBatch, join_ragged
from services.coordinator.fleet.clients import Generated, RewardSample, RolloutClient, ScoredSample
from services.run.data import Prompt
from services.coordinator.fleet.dispatch import map_shards_recovering
from services.coordinator.fleet.reward_set import RewardSet, Scored, ScoredBy
from services.coordinator.fleet.rollout_set import RolloutSet
from services.coordinator.settings import Sampling
from services.coordinator.waiting import Notices

GENERATION_ATTEMPTS = 3  # a batch generated again after every rollout of a shard failed, before giving up


@dataclass(frozen=True, kw_only=True)
class Lineage:
    """Who made one response: the rollout replica that sampled it and, once it is scored, the reward replica that
    scored it, the decoded prompt and response it scored, and what it said."""

    rollout: str  # the rollout replica's address (a trajectory: its first turn's)
    trace: AgentTrace | None = None  # a trajectory's turns, tools and episode, the same for each of its samples
    # (None: a single-turn response)
    scored_by: ScoredBy | None = None
    sample: RewardSample | None = None
    scored: ScoredSample | None = None


class ByTrajectory(NamedTuple):
    """A batch seen by trajectory, [B*n] each: what the estimators and the step's data metrics see. The batch's
    token tensors ([T]) need no change for it: a trajectory's tokens are its samples' response tokens, one
    sample after the other, as the batch holds them."""

    response_lens: torch.Tensor  # its samples' response tokens together
    prompt_lens: torch.Tensor  # its first sample's
    scores: torch.Tensor
    truncated: torch.Tensor  # its last sample's
    group_ids: torch.Tensor  # its prompt
    baselines: torch.Tensor | None


@dataclass(frozen=True, kw_only=True)
class Rollouts:
    """Responses to a batch of prompts: n per prompt, trajectory i*n+j is sample j of prompt i.

    Each trajectory is one row of the batch (a sample), or several consecutive ones where a multi-turn trajectory
    went on in a new sample because its chat template could not extend it (``samples_per_trajectory``). The
    per-row fields ([S]) are per sample; the samples of one trajectory share its score, environment score and
    baseline, and the estimators see the trajectory (``by_trajectory``): one score, one group member, whose
    advantages reach every one of its samples' model tokens.
    """

    batch: SequenceBatch  # [S] samples
    logprobs: torch.Tensor  # [T], from the rollout engine
    truncated: torch.Tensor  # [S] bool (a trajectory's earlier samples: False)
    scores: torch.Tensor  # [S] float32 (zeros until scored): the trajectory's
    versions: torch.Tensor  # [S] int64, the weight version that sampled each sample's first token
    last_versions: torch.Tensor  # [S] int64, its last token's (later if new weights came in while it was sampled)
    prompts: list[Prompt]  # [B]
    n: int
    lineage: tuple[Lineage, ...]  # [S]
    env_scores: torch.Tensor | None = None  # [S] float32, trajectories' weighted environment rewards (None: none)
    baselines: torch.Tensor | None = None  # [S] float32: the score of a greedy response to each one's prompt
    # (an estimator's greedy_baseline); None where the run does not generate them
    samples_per_trajectory: torch.Tensor | None = None  # [B*n] int64 (None: one each)
    agent_scores: torch.Tensor | None = None  # [S] float32: the score an agent environment's agent decided (NaN:
    # the reward service's; None: no agent environment)

    @property
    def trajectory_ids(self) -> torch.Tensor:
        """[S] int64: the trajectory of each sample."""
        if self.samples_per_trajectory is None:
            return torch.arange(len(self.batch))
        return torch.arange(len(self.samples_per_trajectory)).repeat_interleave(self.samples_per_trajectory)

    @property
    def last_rows(self) -> torch.Tensor:
        """[B*n] int64: each trajectory's last sample (the one its final turn ends)."""
        if self.samples_per_trajectory is None:
            return torch.arange(len(self.batch))
        return torch.cumsum(self.samples_per_trajectory, 0) - 1

    @property
    def first_rows(self) -> torch.Tensor:
        """[B*n] int64: each trajectory's first sample (the one that starts from its prompt)."""
        if self.samples_per_trajectory is None:
            return torch.arange(len(self.batch))
        return self.last_rows - self.samples_per_trajectory + 1

    @property
    def group_ids(self) -> torch.Tensor:
        """[S] int64: the prompt of each sample."""
        return torch.div(self.trajectory_ids, self.n, rounding_mode="floor")

    def by_trajectory(self) -> ByTrajectory:
        """The batch by trajectory (a single-turn batch: as it is, each response its own trajectory)."""
        trajectory_ids, last, first = self.trajectory_ids, self.last_rows, self.first_rows
        lengths = torch.zeros(len(last), dtype=torch.int64).index_add(0, trajectory_ids, self.batch.response_lens)
        return ByTrajectory(response_lens=lengths, prompt_lens=self.batch.prompt_lens[first],
                            scores=self.scores[last], truncated=self.truncated[last],
                            group_ids=self.group_ids[last],
                            baselines=None if self.baselines is None else self.baselines[last])

    def prompts_where_every_sample(self, holds: torch.Tensor) -> list[int]:
        """The prompts (indices, in order) each of whose samples ``holds`` ([S] bool)."""
        every = torch.ones(len(self.prompts), dtype=torch.int64).scatter_reduce(0, self.group_ids, holds.long(), "amin")
        return [index for index, kept in enumerate(every.tolist()) if kept]

    def keep_prompts(self, keep: list[int]) -> Rollouts:
        groups = self.group_ids
        rows = torch.cat([torch.nonzero(groups == i).flatten() for i in keep] or [torch.zeros(0, dtype=torch.int64)])
        counts = self.samples_per_trajectory
        return dataclasses.replace(
            self, batch=self.batch.select(rows), logprobs=self.logprobs[self.batch.token_index(rows)],
            truncated=self.truncated[rows], scores=self.scores[rows], versions=self.versions[rows],
            last_versions=self.last_versions[rows], prompts=[self.prompts[i] for i in keep],
            lineage=tuple(self.lineage[row] for row in rows.tolist()),
            env_scores=None if self.env_scores is None else self.env_scores[rows],
            baselines=None if self.baselines is None else self.baselines[rows],
            samples_per_trajectory=None if counts is None else counts.view(-1, self.n)[keep].flatten(),
            agent_scores=None if self.agent_scores is None else self.agent_scores[rows])

    def with_scores(self, samples: list[RewardSample], scored: Scored) -> Rollouts:
        """These rollouts with the scores of ``scored`` (of ``samples``, their trajectories' decoded responses, one
        each), plus the environment's where they have them."""
        trajectory_ids = self.trajectory_ids
        scores = torch.tensor([s.score for s in scored.scores], dtype=torch.float32)[trajectory_ids]
        if self.agent_scores is not None:
            scores = torch.where(torch.isnan(self.agent_scores), scores, self.agent_scores)
        if self.env_scores is not None:
            scores = scores + self.env_scores
        lineage = tuple(dataclasses.replace(origin, scored_by=scored.scored_by[t], sample=samples[t],
                                            scored=scored.scores[t])
                        for origin, t in zip(self.lineage, trajectory_ids.tolist(), strict=True))
        return dataclasses.replace(self, scores=scores, lineage=lineage)

    @staticmethod
    def concat(parts: list[Rollouts]) -> Rollouts:
        counts = (None if all(p.samples_per_trajectory is None for p in parts) else
                  torch.cat([torch.ones(len(p.batch), dtype=torch.int64) if p.samples_per_trajectory is None
                             else p.samples_per_trajectory for p in parts]))
        return Rollouts(batch=SequenceBatch.concat([p.batch for p in parts]),
                        logprobs=torch.cat([p.logprobs for p in parts]),
                        truncated=torch.cat([p.truncated for p in parts]), scores=torch.cat([p.scores for p in parts]),
                        versions=torch.cat([p.versions for p in parts]),
                        last_versions=torch.cat([p.last_versions for p in parts]),
                        prompts=[prompt for p in parts for prompt in p.prompts], n=parts[0].n,
                        lineage=tuple(origin for p in parts for origin in p.lineage),
                        env_scores=None if parts[0].env_scores is None else torch.cat([p.env_scores for p in parts
                                                                                         if p.env_scores is not None]),
                        baselines=(None if any(p.baselines is None for p in parts)
                                   else torch.cat([p.baselines for p in parts if p.baselines is not None])),
                        samples_per_trajectory=counts,
                        agent_scores=(None if any(p.agent_scores is None for p in parts)
                                      else torch.cat([p.agent_scores for p in parts if p.agent_scores is not None])))


@dataclass(frozen=True, kw_only=True)
class Scoring:
    """A batch's rollouts with their scores, and what the reward services were sent and said of each response."""

    rollouts: Rollouts
    samples: list[RewardSample]  # the decoded responses, one per trajectory, in the rollouts' order
    scores: list[ScoredSample]  # one per trajectory
    by_service: dict[str, int]  # service id -> samples it scored


async def generate(rollouts: RolloutSet, prompts: list[Prompt], sampling: Sampling, *, seed: int, oldest: int,
                   timeout_s: float, notices: Notices, what: str) -> tuple[Rollouts, dict[str, int]]:
    """``sampling.n`` responses per prompt from weight versions >= ``oldest`` (not yet scored), and the samples
    each replica produced (by address); ``what`` names the batch in events."""

    async def call(replica: RolloutClient, lo: int, hi: int) -> Generated:
        started = time.monotonic()
        generated = await replica.generate([p.token_ids for p in prompts[lo:hi]], sampling, seed=seed, first_index=lo,
                                           timeout=timeout_s)
        rollouts.speeds.record(replica.address, int(generated.response_lens.sum()), time.monotonic() - started)
        if int(generated.weight_versions.min()) < oldest:
            raise Unavailable(f"rollout {replica.address} generated with weight version "
                              f"{int(generated.weight_versions.min())}, older than {oldest}")
        return generated

    async def refresh(failure: Unavailable) -> None:
        notices.log(f"generation of {what} failed on every rollout ({failure}); refreshing the rollouts and "
                    f"generating it again")
        await rollouts.refresh()

    done = await map_shards_recovering(rollouts.spread, len(prompts), call, attempts=GENERATION_ATTEMPTS,
                                       recover=refresh)
    counts: dict[str, int] = {}
    for result, replica in done:
        counts[replica.address] = counts.get(replica.address, 0) + len(result.response_lens)
    shards = [result for result, _ in done]
    lineage = tuple(Lineage(rollout=replica.address) for result,
                    replica in done for _ in range(len(result.response_lens)))
    prompt_ids, prompt_lens = join_ragged(
        [torch.tensor(p.token_ids) for p in prompts for _ in range(sampling.n)], torch.int64)
    routes = [s.routed_experts for s in shards if s.routed_experts is not None]  # every shard's, where asked for
    batch = SequenceBatch(prompt_ids=prompt_ids, prompt_lens=prompt_lens,
                          response_ids=torch.cat([s.response_ids for s in shards]),
                          response_lens=torch.cat([s.response_lens for s in shards]),
                          routed_experts=torch.cat(routes) if sampling.routed_experts else None)
    produced = Rollouts(batch=batch, logprobs=torch.cat([s.logprobs for s in shards]),
                        truncated=torch.cat([s.truncated for s in shards]), scores=torch.zeros(len(batch)),
                        versions=torch.cat([s.weight_versions for s in shards]),
                        last_versions=torch.cat([s.last_versions for s in shards]), prompts=prompts, n=sampling.n,
                        lineage=lineage)
    return produced, counts


async def generate_trajectories(agent: AgentLoop, prompts: list[Prompt], sampling: Sampling, *, seed: int, oldest: int,
                                timeout_s: float, what: str) -> tuple[Rollouts, dict[str, int], dict[str, float]]:
    """``sampling.n`` trajectories per prompt, their model turns sampled from weight versions >= ``oldest`` (not
    yet scored); the turns each replica sampled (by address), and the trajectories' metrics. ``what`` names the
    batch ("step 5") in the event of an env swap's first batch."""
    trajectories, traces, dispatcher = await agent.run(prompts, sampling, seed, oldest=oldest, timeout_s=timeout_s,
                                                       what=what)
    samples = [sample for trajectory in trajectories for sample in trajectory]
    last = [k == len(trajectory) - 1 for trajectory in trajectories for k in range(len(trajectory))]
    sample_traces = [trace for trajectory, trace in zip(trajectories, traces) for _ in trajectory]
    produced = Rollouts(
        batch=trajectory_batch(samples),
        logprobs=torch.tensor([lp for t in samples for lp in t.logprobs], dtype=torch.float32),
        truncated=torch.tensor([is_last and trace.ended == Ended.LENGTH
                                for is_last, trace in zip(last, sample_traces)]),
        scores=torch.zeros(len(samples)),
        versions=torch.tensor([t.weight_versions[0] if t.weight_versions else oldest for t in samples],
                              dtype=torch.int64),  # (an agent's episode that made no call: its placeholder)
        last_versions=torch.tensor([v for trace in traces for v in trace.last_versions], dtype=torch.int64),
        prompts=prompts, n=sampling.n,
        lineage=tuple(Lineage(rollout=trace.rollouts[0], trace=trace) for trace in sample_traces),
        env_scores=torch.tensor([agent.settings.env_reward_weight * trace.env_reward for trace in sample_traces],
                                dtype=torch.float32),
        samples_per_trajectory=torch.tensor([len(t) for t in trajectories], dtype=torch.int64),
        agent_scores=torch.tensor([math.nan if trace.agent_score is None else trace.agent_score
                                   for trace in sample_traces], dtype=torch.float32)
        if any(trace.agent_outcome for trace in traces) else None)
    return produced, dict(dispatcher.turns), agent_metrics(traces, trajectories)


async def score(rewards: RewardSet, rollouts: Rollouts, tokenizer, *, notices: Notices, what: str) -> Scoring:
    """One score per response, spread over the reward replicas (an invalid sample scores 0, with an event);
    ``what`` names the batch in events."""
    samples = await asyncio.to_thread(reward_samples, rollouts, tokenizer)
    scored = await rewards.score(samples, what)
    invalid = [s.error for s in scored.scores if not s.valid]
    if invalid:
        notices.log(f"{len(invalid)} samples could not be scored (scored 0), first: {invalid[0]}")
    return Scoring(rollouts=rollouts.with_scores(samples, scored), samples=samples, scores=scored.scores,
                   by_service=scored.by_service)


def reward_samples(rollouts: Rollouts, tokenizer) -> list[RewardSample]:
    """Each trajectory's response decoded (a multi-turn one: its final model turn), with its prompt's data source,
    ground truth, extra info and text."""
    responses = torch.split(rollouts.batch.response_ids, rollouts.batch.response_lens.tolist())
    prompt_texts = [tokenizer.decode(p.token_ids, skip_special_tokens=True) for p in rollouts.prompts]
    groups = rollouts.group_ids
    samples = []
    for row in rollouts.last_rows.tolist():
        index, trace = int(groups[row]), rollouts.lineage[row].trace
        prompt = rollouts.prompts[index]
        text = trace.final_text if trace is not None else tokenizer.decode(responses[row].tolist(),
                                                                           skip_special_tokens=True)
        samples.append(RewardSample(data_source=prompt.data_source, response=text,
                                    ground_truth=prompt.ground_truth, extra_info=prompt.extra_info,
                                    prompt=prompt_texts[index]))
    return samples
