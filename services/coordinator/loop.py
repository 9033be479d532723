"""The GRPO loop of one run, driven by the coordinator.

Choices:
- The rollout engines, the trainer and the reward services are remote; this
  loop only moves batches between them and records what happened.
- A step: prompts -> n responses each (spread over the rollout replicas) ->
  scores (spread over the reward replicas) -> old logprobs (trainer) ->
  group-normalised advantages -> one PPO update -> weight sync trainer ->
  every rollout -> metrics. The rollouts then serve the updated weights.
- Before the first step the run loads its model everywhere, opens the weight
  channel, runs the optional supervised warm start, and syncs, so every
  rollout serves exactly the trainer's weights from step 1 on.
- Sampling seeds come from (trainer.seed, step, prompt index), so a prompt's
  samples do not depend on which replica served it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from services import algos
from services.common.run_config import RunConfig
from services.common.sequences import SequenceBatch, join_ragged
from services.coordinator.clients import Generated, RewardClient, RolloutClient, TrainerClient
from services.coordinator.data import Prompt, PromptSampler
from services.coordinator.dispatch import ReplicaPool
from services.coordinator.metrics import StageTimer, rollout_metrics

CHANNEL_TIMEOUT_S = 120.0


class Reporter(Protocol):
    def step(self, step: int, metrics: dict[str, float]) -> None:
        """A step finished with these metrics."""

    def log(self, message: str) -> None:
        """Something a person watching the run should see."""


@dataclass
class RunServices:
    trainer: TrainerClient
    rollouts: list[RolloutClient]
    rewards: list[RewardClient]


@dataclass(frozen=True)
class Rollouts:
    """The responses of one step: n per prompt, sequence i*n+j is sample j of prompt i."""

    batch: SequenceBatch
    logprobs: torch.Tensor  # [T], from the rollout engine
    truncated: torch.Tensor  # [B*n] bool
    group_ids: torch.Tensor  # [B*n], the prompt each sequence answers
    prompts: list[Prompt]  # [B]


class GRPOLoop:
    def __init__(
        self, run_id: str, config: RunConfig, config_yaml: str, services: RunServices, prompts: list[Prompt],
        tokenizer, reporter: Reporter, should_stop: Callable[[], bool],
    ):
        self.run_id, self.config, self.config_yaml = run_id, config, config_yaml
        self.services, self.prompts, self.tokenizer = services, prompts, tokenizer
        self.reporter, self.should_stop = reporter, should_stop
        seed, data = config.trainer.seed, config.data
        self.sampler = PromptSampler(len(prompts), data.train_batch_size, data.shuffle, seed)
        self.rollout_pool = ReplicaPool("rollout", services.rollouts)
        self.reward_pool = ReplicaPool("reward", services.rewards)
        self.timeout = config.trainer.rpc_timeout_s
        self.channel_id = f"{run_id}-weights"

    async def run(self) -> bool:
        """Set up, then train until the last step or a stop request; True if every step ran."""
        await self.set_up()
        for step in range(1, self.config.trainer.total_training_steps + 1):
            if self.should_stop():
                return False
            self.reporter.step(step, await self.step(step))
        return True

    async def step(self, step: int) -> dict[str, float]:
        timer = StageTimer()
        with timer("gen"):
            rollouts = await self.generate(step)
        with timer("reward"):
            scores = await self.score(rollouts)
        with timer("old_log_prob"):
            old_logprobs = await self.services.trainer.compute_log_probs(rollouts.batch, step, self.timeout)
        with timer("adv"):
            per_sequence = algos.grpo_advantages(scores, rollouts.group_ids, self.config.algorithm.norm_adv_by_std_in_grpo)
            advantages = algos.expand_per_token(per_sequence, rollouts.batch.response_lens)
        with timer("update_actor"):
            actor_metrics, version = await self.services.trainer.update_actor(
                rollouts.batch, old_logprobs, advantages, step, self.timeout)
        with timer("update_weights"):
            await self.sync_weights(version)
        metrics = {
            **actor_metrics,
            **rollout_metrics(scores, advantages, rollouts.batch.response_lens, rollouts.truncated,
                              rollouts.logprobs, old_logprobs),
            **timer.metrics(),
            "weight_version": float(version),
        }
        tokens = rollouts.batch.num_response_tokens + int(rollouts.batch.prompt_lens.sum())
        metrics["perf/total_num_tokens"] = float(tokens)
        metrics["perf/throughput"] = tokens / metrics["timing_s/step"]
        return metrics

    async def set_up(self) -> None:
        """Load the model everywhere, open the weight channel, warm start, and sync."""
        model = self.config.actor_rollout_ref.model
        seed = self.config.trainer.seed
        await asyncio.gather(
            self.services.trainer.init_run(self.run_id, self.config_yaml, seed, self.timeout),
            *(r.init_run(self.run_id, model.path, model.dtype, self.timeout) for r in self.services.rollouts),
        )
        world_size = 1 + len(self.services.rollouts)
        rendezvous = await self.services.trainer.prepare_channel(self.channel_id, world_size)
        await asyncio.gather(
            self.services.trainer.join_channel(self.channel_id, rendezvous, world_size, CHANNEL_TIMEOUT_S),
            *(r.join_channel(self.channel_id, rendezvous, rank, world_size, CHANNEL_TIMEOUT_S)
              for rank, r in enumerate(self.services.rollouts, start=1)),
        )
        version = await self.warm_start()
        await self.sync_weights(version)

    async def warm_start(self) -> int:
        """Supervised steps on the ground-truth responses; returns the trainer's weight version."""
        settings = self.config.actor_rollout_ref.actor.warm_start
        sampler = PromptSampler(len(self.prompts), settings.batch_size, True, self.config.trainer.seed + 1)
        version, metrics = 0, {}
        for index in range(settings.steps):
            chosen = [self.prompts[i] for i in sampler.next_batch()]
            responses = [self.encode_target(p) for p in chosen]
            batch = make_batch([p.token_ids for p in chosen], responses)
            metrics, version = await self.services.trainer.train_supervised(batch, 0, self.timeout)
            if (index + 1) % max(1, settings.steps // 5) == 0:
                self.reporter.log(f"warm start {index + 1}/{settings.steps}: loss {metrics['warm_start/loss']:.3f}")
        return version

    def encode_target(self, prompt: Prompt) -> list[int]:
        """The ground truth as the response the warm start teaches, ending in EOS."""
        ids = self.tokenizer(prompt.ground_truth, add_special_tokens=False)["input_ids"]
        return ids + [self.tokenizer.eos_token_id]

    async def generate(self, step: int) -> Rollouts:
        """n responses per prompt of the next batch, spread over the rollout replicas."""
        rollout = self.config.actor_rollout_ref.rollout
        indices = self.sampler.next_batch()
        chosen = [self.prompts[i] for i in indices]
        seed = self.config.trainer.seed * 1_000_003 + step

        async def call(replica: RolloutClient, lo: int, hi: int) -> Generated:
            return await replica.generate(
                [p.token_ids for p in chosen[lo:hi]], rollout.n, rollout.temperature, rollout.top_p,
                self.config.data.max_response_length, seed, lo, rollout.stop_token_ids, self.timeout)

        shards = [result for result, _ in await self.rollout_pool.map_shards(len(chosen), call)]
        n = rollout.n
        prompt_ids, prompt_lens = join_ragged(
            [torch.tensor(p.token_ids) for p in chosen for _ in range(n)], torch.int64)
        batch = SequenceBatch(
            prompt_ids, prompt_lens,
            torch.cat([s.response_ids for s in shards]), torch.cat([s.response_lens for s in shards]))
        return Rollouts(
            batch, torch.cat([s.logprobs for s in shards]), torch.cat([s.truncated for s in shards]),
            torch.arange(len(chosen)).repeat_interleave(n), chosen)

    async def score(self, rollouts: Rollouts) -> torch.Tensor:
        """One score per response, spread over the reward replicas; [B*n] float32."""
        n = self.config.actor_rollout_ref.rollout.n
        responses = torch.split(rollouts.batch.response_ids, rollouts.batch.response_lens.tolist())
        samples = []
        for row, response in enumerate(responses):
            prompt = rollouts.prompts[row // n]
            text = self.tokenizer.decode(response.tolist(), skip_special_tokens=True)
            samples.append((prompt.data_source, text, prompt.ground_truth, prompt.extra_info))

        async def call(replica: RewardClient, lo: int, hi: int):
            return await replica.score(samples[lo:hi], self.timeout)

        shards = await self.reward_pool.map_shards(len(samples), call)
        scored = [s for (scores, _), _ in shards for s in scores]
        invalid = [s.error for s in scored if not s.valid]
        if invalid:
            self.reporter.log(f"{len(invalid)} samples could not be scored (scored 0), first: {invalid[0]}")
        return torch.tensor([s.score for s in scored], dtype=torch.float32)

    async def sync_weights(self, version: int) -> None:
        """Broadcast the actor's weights to every rollout; each must then serve ``version``."""
        timeout = CHANNEL_TIMEOUT_S
        bucket = self.config.trainer.weight_sync_bucket_mb << 20
        sent, *received = await asyncio.gather(
            self.services.trainer.broadcast_weights(self.channel_id, bucket, timeout),
            *(r.receive_weights(self.channel_id, timeout) for r in self.services.rollouts),
        )
        stale = [r.address for r, v in zip(self.services.rollouts, received) if v != sent.weight_version]
        if sent.weight_version != version or stale:
            raise RuntimeError(f"weight sync to version {version} failed: trainer sent {sent.weight_version}, "
                               f"rollouts not serving it: {stale}")


def make_batch(prompts: list[list[int]], responses: list[list[int]]) -> SequenceBatch:
    prompt_ids, prompt_lens = join_ragged([torch.tensor(p) for p in prompts], torch.int64)
    response_ids, response_lens = join_ragged([torch.tensor(r) for r in responses], torch.int64)
    return SequenceBatch(prompt_ids, prompt_lens, response_ids, response_lens)
