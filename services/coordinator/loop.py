"""The PPO loop of one run (GAE with a critic, GRPO, RLOO, REINFORCE++), driven by the coordinator.

Choices:
- The rollout engines, the trainer roles (actor, critic, reference) and the
  reward services are remote; this loop only moves batches between them and
  records what happened.
- A step: prompts -> n responses each (spread over the rollout replicas) ->
  scores (spread over the reward replicas; with DAPO dynamic sampling, groups
  whose scores are all equal are dropped and more prompts generated) -> old
  logprobs, reference logprobs and values, concurrently -> token rewards
  (minus the KL penalty when it goes into the reward) -> advantages ->
  critic and actor updates, concurrently -> weight sync trainer -> every
  rollout -> metrics.
- Before the first step the run loads its roles everywhere, opens the weight
  channel, runs the optional supervised warm start, and syncs, so every
  rollout serves exactly the trainer's weights from step 1 on.
- Rollouts come and go (``RolloutSet``): one that fails mid-step has its
  shard redone on the others, newcomers are taken in at step boundaries with
  the current weights, and each shard must come back generated with them.
- Sampling seeds come from (trainer.seed, step, round, prompt index), so a
  prompt's samples do not depend on which replica served it.
- Generation runs ahead of training by up to trainer.async_.max_staleness
  steps (``Pipeline``): the batch of step s is generated (and scored) once
  step s-1-K is updated and synced, so every sample was drawn from weights
  at most K versions older than those it is trained from; each sample
  carries its version, staleness is a metric, and a sample older than K
  (which the pipeline never produces) would be dropped with its group and
  counted. K = 0 is the synchronous loop, step for step.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

import torch

from services import algos
from services.common.errors import Unavailable
from services.common.run_config import RunConfig
from services.common.sequences import SequenceBatch, join_ragged
from services.common.timing import StageTimer
from services.coordinator.clients import Generated, RewardClient, RewardSample, RolloutClient, TrainerClient
from services.coordinator.data import Prompt, PromptSampler
from services.coordinator.dispatch import ReplicaPool, map_shards_recovering
from services.coordinator.metrics import data_metrics
from services.coordinator.pipeline import Pipeline
from services.coordinator.rollout_set import RolloutSet
from services.coordinator.store import Checkpoint
from services.coordinator.waiting import wait_for

GENERATION_ATTEMPTS = 3  # a step's generation redone after every rollout of a shard failed, before giving up
SCORING_ATTEMPTS = 3  # the same for scoring, after every reward replica failed
REWARD_PROBE_TIMEOUT_S = 2.0


class Reporter(Protocol):
    def step(self, step: int, metrics: dict[str, float]) -> None:
        """A step finished with these metrics."""

    def log(self, message: str, kind: str = "log") -> None:
        """Something a person watching the run should see (kind: log, or reward for reward swaps)."""

    def checkpoint(self, step: int, path: str, loop_state: dict) -> None:
        """Every trainer has saved step ``step`` under ``path``; ``loop_state`` is the coordinator's part."""

    def waiting(self, reason: str | None) -> None:
        """The run waits for ``reason`` (state waiting); None: it goes on (state running)."""


@dataclass
class RunServices:
    """The run's trainers and reward services; roles placed on the same trainer share one client. (The
    rollouts are the loop's RolloutSet.)"""

    actor: TrainerClient
    critic: TrainerClient | None
    ref: TrainerClient | None
    rewards: list[RewardClient]

    def trainer_roles(self) -> dict[TrainerClient, list[str]]:
        roles: dict[TrainerClient, list[str]] = {}
        for role, client in (("actor", self.actor), ("critic", self.critic), ("ref", self.ref)):
            if client is not None:
                roles.setdefault(client, []).append(role)
        return roles

    def clients(self) -> list:
        return [*self.trainer_roles(), *self.rewards]


@dataclass(frozen=True)
class RewardTarget:
    """Where a run's rewards come from: every reward service up in a group, or one address."""

    kind: str  # group or address
    name: str

    def __str__(self) -> str:
        return f"{self.kind} {self.name}"


@dataclass(frozen=True)
class Rollouts:
    """Scored responses of one step: n per prompt, sequence i*n+j is sample j of prompt i."""

    batch: SequenceBatch
    logprobs: torch.Tensor  # [T], from the rollout engine
    truncated: torch.Tensor  # [B*n] bool
    scores: torch.Tensor  # [B*n] float32
    versions: torch.Tensor  # [B*n] int64, the weight version that sampled each response
    prompts: list[Prompt]  # [B]
    n: int

    @property
    def group_ids(self) -> torch.Tensor:
        return torch.arange(len(self.prompts)).repeat_interleave(self.n)

    def keep_prompts(self, keep: list[int]) -> Rollouts:
        rows = torch.tensor([i * self.n + j for i in keep for j in range(self.n)], dtype=torch.int64)
        return Rollouts(self.batch.select(rows), self.logprobs[self.batch.token_index(rows)], self.truncated[rows],
                        self.scores[rows], self.versions[rows], [self.prompts[i] for i in keep], self.n)

    def with_scores(self, scores: torch.Tensor) -> Rollouts:
        return Rollouts(self.batch, self.logprobs, self.truncated, scores, self.versions, self.prompts, self.n)

    @staticmethod
    def concat(parts: list[Rollouts]) -> Rollouts:
        return Rollouts(SequenceBatch.concat([p.batch for p in parts]), torch.cat([p.logprobs for p in parts]),
                        torch.cat([p.truncated for p in parts]), torch.cat([p.scores for p in parts]),
                        torch.cat([p.versions for p in parts]), [prompt for p in parts for prompt in p.prompts],
                        parts[0].n)


@dataclass(frozen=True)
class Produced:
    """A step's scored batch, as the generation side hands it to the training side."""

    rollouts: Rollouts
    metrics: dict[str, float]  # of the generation: filtering, samples per replica
    seconds: dict[str, float]  # stage -> seconds spent generating and scoring it


class PPOLoop:
    def __init__(self, run_id: str, config: RunConfig, config_yaml: str, services: RunServices,
                 prompts: list[Prompt], tokenizer, reporter: Reporter, should_stop: Callable[[], bool],
                 find_rewards: Callable[[RewardTarget], list[str]], find_rollouts: Callable[[], list[str]],
                 checkpoint_dir: Path):
        self.run_id, self.config, self.config_yaml = run_id, config, config_yaml
        self.services, self.prompts, self.tokenizer = services, prompts, tokenizer
        self.reporter, self.should_stop = reporter, should_stop
        seed, data = config.trainer.seed, config.data
        self.sampler = PromptSampler(len(prompts), data.train_batch_size, data.shuffle, seed)
        self.rollouts = RolloutSet(run_id, config, services.actor, find_rollouts, reporter, should_stop)
        self.reward_pool = ReplicaPool("reward", services.rewards)
        self.timeout = config.trainer.rpc_timeout_s
        self.kl_coef = config.algorithm.kl_ctrl.kl_coef
        self.find_rewards = find_rewards  # the addresses of the reward services of a target, up now
        self.reward_target = RewardTarget("group", config.placement.reward)
        self.next_rewards: tuple[list[RewardClient], RewardTarget] | None = None  # a swap waiting for the boundary
        self.checkpoint_dir = checkpoint_dir
        self.saved_step = 0  # last step checkpointed (or resumed from)
        self.data_after: dict[int, dict] = {}  # step -> the data sampler's state right after its batch was drawn
        self._retired: list[RewardClient] = []  # reward clients left at the last boundary, closed at the next

    async def run(self, resume: Checkpoint | None = None) -> bool:
        """Set up (from ``resume`` if given), then train until the last step or a stop request, checkpointing
        every trainer.save_freq steps and at a stop; True if every step ran."""
        await self.set_up(resume)
        first, last = self.saved_step + 1, self.config.trainer.total_training_steps
        if self.should_stop():
            return False
        await self.boundary(first)
        pipeline = Pipeline(self.produce, self.data_state, first, last, self.config.trainer.async_.max_staleness)
        pipeline.start()
        try:
            for step in range(first, last + 1):
                timer = StageTimer()
                ahead = await pipeline.next(step)                          # generated (ahead, when K > 0)
                metrics = await self.train(step, ahead.batch, timer)      # trained, synced
                self.data_after[step] = ahead.data_state
                metrics["perf/rollout_idle_fraction"] = pipeline.idle_fraction(since=timer.started)
                self.reporter.step(step, metrics)
                if self.config.trainer.save_freq and step % self.config.trainer.save_freq == 0:
                    await self.save_checkpoint(step)
                if self.should_stop() and step < last:
                    if step > self.saved_step:
                        await self.save_checkpoint(step)
                    return False
                if step < last:
                    await self.boundary(step + 1)
                await pipeline.complete(step)                             # later batches may be begun
        finally:
            await pipeline.close()
            await asyncio.gather(*(client.close() for client in self._retired if client not in self.services.rewards))
        return True

    async def boundary(self, step: int) -> None:
        """Before step ``step`` is generated: apply a reward swap, follow the reward and rollout replicas."""
        await self.update_rewards(step)
        await self.rollouts.refresh()

    def data_state(self) -> dict:
        return {"epoch": self.sampler.epoch, "position": self.sampler.position}

    def loop_state(self, step: int) -> dict:
        """What the coordinator must keep to go on after step ``step``: the data sampler as it was right after
        that step's batch was drawn (it may have run ahead since), the KL coefficient, the reward target."""
        return {**self.data_after[step], "kl_coef": self.kl_coef,
                "reward_target": [self.reward_target.kind, self.reward_target.name]}

    async def save_checkpoint(self, step: int) -> None:
        """Each trainer saves its roles under checkpoints/step_N/<roles>; then the run DB records the step."""
        folder = self.checkpoint_dir / f"step_{step:06d}"
        await asyncio.gather(*(trainer.save_checkpoint(self.run_id, str(folder / "-".join(roles)), self.timeout)
                               for trainer, roles in self.services.trainer_roles().items()))
        self.reporter.checkpoint(step, str(folder), self.loop_state(step))
        self.saved_step = step
        self.data_after = {later: state for later, state in self.data_after.items() if later > step}

    async def restore(self, resume: Checkpoint) -> int:
        """Load every trainer's roles and the loop's own state; returns the actor's weight version."""
        folder = Path(resume.path)
        versions = await asyncio.gather(*(trainer.load_checkpoint(self.run_id, str(folder / "-".join(roles)),
                                                                  self.timeout)
                                          for trainer, roles in self.services.trainer_roles().items()))
        state = resume.loop_state
        self.sampler.epoch, self.sampler.position, self.kl_coef = state["epoch"], state["position"], state["kl_coef"]
        self.reward_target = RewardTarget(*state["reward_target"])
        self.saved_step = resume.step
        self.reporter.log(f"resumed from the checkpoint of step {resume.step}")
        return versions[list(self.services.trainer_roles()).index(self.services.actor)]

    def swap_rewards(self, clients: list[RewardClient], target: RewardTarget) -> None:
        """Use these reward services (and later ones of their target) from the next step on; they were probed."""
        self.next_rewards = (clients, target)

    async def update_rewards(self, step: int) -> None:
        """At a step boundary: apply a requested swap, then follow the target's replicas as they come and go."""
        clients = self.services.rewards
        if self.next_rewards is not None:
            (clients, self.reward_target), self.next_rewards = self.next_rewards, None
            self.reporter.log(f"reward services switched to {self.reward_target} from step {step}", kind="reward")
        addresses = self.find_rewards(self.reward_target) or [c.address for c in clients]  # none up: keep trying
        await self.use_rewards(clients, addresses, f"from step {step}")

    async def wait_for_rewards(self) -> None:
        """Every reward replica failed a batch: wait (state waiting) until a service of the target answers
        an empty Score (a dead one stays registered until it misses its heartbeats)."""
        addresses = await wait_for(self.answering_rewards, self.reporter, self.should_stop,
                                   f"no reward service of {self.reward_target} answers: waiting for one to register")
        await self.use_rewards(self.services.rewards, addresses, "to score the batch again")

    async def answering_rewards(self) -> list[str]:
        clients = [RewardClient(address) for address in self.find_rewards(self.reward_target)]
        answers = await asyncio.gather(*(c.score([], REWARD_PROBE_TIMEOUT_S) for c in clients), return_exceptions=True)
        await asyncio.gather(*(c.close() for c in clients))
        return [c.address for c, answer in zip(clients, answers) if not isinstance(answer, BaseException)]

    async def use_rewards(self, clients: list[RewardClient], addresses: list[str], when: str) -> None:
        """Score with the services at ``addresses`` (reusing the clients of ``clients`` that are among them)."""
        by_address = {client.address: client for client in clients}
        if set(addresses) != set(by_address):
            self.reporter.log(f"reward replicas of {self.reward_target} {when}: {sorted(addresses)}", kind="reward")
        new = [by_address.get(address) or RewardClient(address) for address in addresses]
        retired = [c for c in {*self.services.rewards, *clients} if c not in new]
        self.services.rewards, self.reward_pool = new, ReplicaPool("reward", new)
        # closed one boundary later: a batch generated ahead may still be scoring on them
        await asyncio.gather(*(client.close() for client in self._retired if client not in new))
        self._retired = retired

    async def produce(self, step: int) -> Produced:
        """The generation side of a step: its batch generated and scored (from weights no older than those the
        rollouts serve now)."""
        timer, counts = StageTimer(), {}
        rollouts, filter_metrics = await self.generate_and_score(step, timer, counts, self.rollouts.served)
        return Produced(rollouts, {**filter_metrics, **{name: float(n) for name, n in counts.items()}}, timer.seconds)

    async def train(self, step: int, produced: Produced, timer: StageTimer) -> dict[str, float]:
        """The training side of a step: logprobs, advantages, updates, weight sync; returns the step's metrics."""
        config, trainers, timeout = self.config, self.services, self.timeout
        timer.seconds.update(produced.seconds)
        rollouts, off_policy = self.within_staleness(produced.rollouts)          # 1. responses and scores
        sleeping = config.actor_rollout_ref.rollout.free_cache_engine
        if sleeping:                                                             # the GPU is the trainer's now
            with timer("rollout_sleep"):
                await self.rollouts.sleep()
        batch = rollouts.batch
        old_logprobs, ref_logprobs, values = await asyncio.gather(               # 2. what the update needs
            timer.timed("old_log_prob", trainers.actor.compute_log_probs(batch, step, timeout)),
            timer.timed("ref", trainers.ref.compute_log_probs(batch, step, timeout, role="ref")) if trainers.ref else none(),
            timer.timed("values", trainers.critic.compute_values(batch, step, timeout)) if trainers.critic else none())
        with timer("adv"):                                                       # 3. rewards and advantages
            rewards, kl_metrics = self.token_rewards(rollouts, old_logprobs, ref_logprobs)
            estimate = algos.compute_advantages(
                config.algorithm.adv_estimator, rewards, batch.response_lens, rollouts.group_ids, values,
                config.algorithm.gamma, config.algorithm.lam, config.algorithm.norm_adv_by_std_in_grpo)
        update_actor = step > config.trainer.critic_warmup                       # 4. updates
        rollout_logprobs = rollouts.logprobs if config.use_rollout_correction else None
        critic_metrics, (actor_metrics, version) = await asyncio.gather(
            timer.timed("update_critic", trainers.critic.update_critic(batch, values, estimate.returns, step, timeout))
            if trainers.critic else none({}),
            timer.timed("update_actor", trainers.actor.update_actor(
                batch, old_logprobs, estimate.advantages, ref_logprobs, step, timeout, rollout_logprobs=rollout_logprobs))
            if update_actor else none(({}, -1)))
        if sleeping:
            with timer("rollout_wake_up"):
                await self.rollouts.wake_up()
        if update_actor:                                                         # 5. rollouts serve the new weights
            with timer("update_weights"):
                await self.rollouts.sync(version)
            timer.seconds["rollout_pause"] = self.rollouts.pause_s
        metrics = {**actor_metrics, **critic_metrics, **kl_metrics, **produced.metrics, **off_policy, **timer.metrics(),
                   **data_metrics(rollouts.scores, rewards, estimate.advantages, estimate.returns, values,
                                  batch.response_lens, batch.prompt_lens, rollouts.truncated, rollouts.logprobs,
                                  old_logprobs)}
        tokens = batch.num_response_tokens + int(batch.prompt_lens.sum())
        metrics.update({"perf/total_num_tokens": float(tokens), "perf/throughput": tokens / metrics["timing_s/step"],
                        "training/weight_version": float(version if update_actor else -1)})
        return metrics

    def within_staleness(self, rollouts: Rollouts) -> tuple[Rollouts, dict[str, float]]:
        """The rollouts whose every sample is at most trainer.async_.max_staleness versions older than the
        weights the update starts from (prompts with an older sample are dropped, and counted), and the
        staleness metrics."""
        limit = self.config.trainer.async_.max_staleness
        staleness = (self.rollouts.served - rollouts.versions).float()
        keep = [i for i in range(len(rollouts.prompts)) if staleness[i * rollouts.n:(i + 1) * rollouts.n].max() <= limit]
        metrics = {"rollout/weight_version": float(rollouts.versions.min()),
                   "training/off_policy/staleness/mean": float(staleness.mean()),
                   "training/off_policy/staleness/max": float(staleness.max()),
                   "training/off_policy/dropped_samples": float((len(rollouts.prompts) - len(keep)) * rollouts.n)}
        if len(keep) == len(rollouts.prompts):
            return rollouts, metrics
        if not keep:
            raise RuntimeError(f"every sample of the batch is more than {limit} weight versions old")
        self.reporter.log(f"dropped {metrics['training/off_policy/dropped_samples']:.0f} samples more than {limit} "
                          f"weight versions old")
        return rollouts.keep_prompts(keep), metrics

    async def set_up(self, resume: Checkpoint | None) -> None:
        """Load the roles and models everywhere, open the weight channel, warm start (or restore), and sync."""
        seed = self.config.trainer.seed
        await asyncio.gather(
            *(trainer.init_run(self.run_id, self.config_yaml, roles, seed, self.timeout)
              for trainer, roles in self.services.trainer_roles().items()),
            self.rollouts.form(),
        )
        if self.config.actor_rollout_ref.rollout.free_cache_engine:
            await self.rollouts.wake_up()  # one an earlier attempt left asleep
        version = await (self.restore(resume) if resume else self.warm_start())
        await self.rollouts.sync(version)

    async def warm_start(self) -> int:
        """Supervised steps on the ground-truth responses; returns the trainer's weight version."""
        settings = self.config.actor_rollout_ref.actor.warm_start
        sampler = PromptSampler(len(self.prompts), settings.batch_size, True, self.config.trainer.seed + 1)
        version = 0
        for index in range(settings.steps):
            chosen = [self.prompts[i] for i in sampler.next_batch()]
            batch = make_batch([p.token_ids for p in chosen], [self.encode_target(p) for p in chosen])
            metrics, version = await self.services.actor.train_supervised(batch, 0, self.timeout)
            if (index + 1) % max(1, settings.steps // 5) == 0:
                self.reporter.log(f"warm start {index + 1}/{settings.steps}: loss {metrics['warm_start/loss']:.3f}")
        return version

    def encode_target(self, prompt: Prompt) -> list[int]:
        """The ground truth as the response the warm start teaches, ending in EOS."""
        ids = self.tokenizer(prompt.ground_truth, add_special_tokens=False)["input_ids"]
        return ids + [self.tokenizer.eos_token_id]

    async def generate_and_score(self, step: int, timer: StageTimer, counts: dict[str, int],
                                 oldest: int) -> tuple[Rollouts, dict[str, float]]:
        """The step's scored responses, sampled from weight versions >= ``oldest``; ``counts`` gets the samples
        each replica produced. With DAPO dynamic sampling, groups whose scores are all equal are dropped and
        further batches generated, up to filter_groups.max_num_gen_batches rounds."""
        settings, wanted = self.config.algorithm.filter_groups, self.config.data.train_batch_size
        kept: list[Rollouts] = []
        rounds = settings.max_num_gen_batches if settings.enable else 1
        for round_index in range(rounds):
            with timer("gen"):
                rollouts = await self.generate(step, round_index, counts, oldest)
            with timer("reward"):
                rollouts = await self.score(rollouts, counts)
            if not settings.enable:
                return rollouts, {}
            signal = algos.groups_with_signal(rollouts.scores, rollouts.group_ids)
            keep = [i for i in range(len(rollouts.prompts)) if bool(signal[i * rollouts.n])]
            kept.append(rollouts.keep_prompts(keep))
            if sum(len(part.prompts) for part in kept) >= wanted:
                break
        merged = Rollouts.concat(kept) if any(part.prompts for part in kept) else rollouts
        merged = merged.keep_prompts(list(range(min(wanted, len(merged.prompts)))))
        return merged, {"training/filter_groups/kept_prompts": float(len(merged.prompts)),
                        "training/filter_groups/gen_rounds": float(round_index + 1)}

    async def generate(self, step: int, round_index: int, counts: dict[str, int], oldest: int) -> Rollouts:
        """n responses per prompt of the next batch, spread over the rollout replicas (not yet scored).

        A shard whose replica fails, or comes back generated with weights older than ``oldest``, is redone on
        another; if every replica fails, the rollouts are refreshed (waiting for one if none is left) and the
        whole generation redone: same prompts, same seeds, so nothing is lost or counted twice."""
        rollout = self.config.actor_rollout_ref.rollout
        chosen = [self.prompts[i] for i in self.sampler.next_batch()]
        seed = (self.config.trainer.seed * 1_000_003 + step) * 101 + round_index

        async def call(replica: RolloutClient, lo: int, hi: int) -> Generated:
            generated = await replica.generate(
                [p.token_ids for p in chosen[lo:hi]], rollout.n, rollout.temperature, rollout.top_p,
                self.config.data.max_response_length, seed, lo, rollout.stop_token_ids, self.timeout)
            if int(generated.weight_versions.min()) < oldest:
                raise Unavailable(f"rollout {replica.address} generated with weight version "
                                  f"{int(generated.weight_versions.min())}, older than {oldest}")
            return generated

        async def refresh(failure: Unavailable) -> None:
            self.reporter.log(f"generation of step {step} failed on every rollout ({failure}); refreshing the "
                              f"rollouts and generating it again")
            await self.rollouts.refresh()

        done = await map_shards_recovering(lambda: self.rollouts.pool, len(chosen), call, GENERATION_ATTEMPTS, refresh)
        for result, replica in done:
            name = f"rollout/samples_by/{replica.address}"
            counts[name] = counts.get(name, 0) + len(result.response_lens)
        shards = [result for result, _ in done]
        prompt_ids, prompt_lens = join_ragged(
            [torch.tensor(p.token_ids) for p in chosen for _ in range(rollout.n)], torch.int64)
        batch = SequenceBatch(prompt_ids, prompt_lens, torch.cat([s.response_ids for s in shards]),
                              torch.cat([s.response_lens for s in shards]))
        return Rollouts(batch, torch.cat([s.logprobs for s in shards]), torch.cat([s.truncated for s in shards]),
                        torch.zeros(len(batch)), torch.cat([s.weight_versions for s in shards]), chosen, rollout.n)

    async def score(self, rollouts: Rollouts, counts: dict[str, int]) -> Rollouts:
        """The same rollouts with one score per response, spread over the reward replicas."""
        responses = torch.split(rollouts.batch.response_ids, rollouts.batch.response_lens.tolist())
        prompt_texts = [self.tokenizer.decode(p.token_ids, skip_special_tokens=True) for p in rollouts.prompts]
        samples = []
        for row, response in enumerate(responses):
            prompt = rollouts.prompts[row // rollouts.n]
            text = self.tokenizer.decode(response.tolist(), skip_special_tokens=True)
            samples.append(RewardSample(prompt.data_source, text, prompt.ground_truth, prompt.extra_info,
                                        prompt_texts[row // rollouts.n]))

        async def call(replica: RewardClient, lo: int, hi: int):
            return await replica.score(samples[lo:hi], self.timeout)

        async def wait(failure: Unavailable) -> None:
            self.reporter.log(f"scoring failed on every reward replica ({failure}); waiting for the reward "
                              f"services and scoring the batch again")
            await self.wait_for_rewards()

        shards = await map_shards_recovering(lambda: self.reward_pool, len(samples), call, SCORING_ATTEMPTS, wait)
        scored = [s for (scores, _), _ in shards for s in scores]
        for (scores, service_id), _ in shards:  # who scored what
            name = f"reward/samples_by/{service_id}"
            counts[name] = counts.get(name, 0) + len(scores)
        invalid = [s.error for s in scored if not s.valid]
        if invalid:
            self.reporter.log(f"{len(invalid)} samples could not be scored (scored 0), first: {invalid[0]}")
        return rollouts.with_scores(torch.tensor([s.score for s in scored], dtype=torch.float32))

    def token_rewards(self, rollouts: Rollouts, old_logprobs: torch.Tensor,
                      ref_logprobs: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, float]]:
        """Scores on the last tokens, minus the KL penalty when it goes into the reward (and its controller)."""
        algorithm, lengths = self.config.algorithm, rollouts.batch.response_lens
        if not algorithm.use_kl_in_reward:
            return algos.token_rewards(rollouts.scores, lengths), {}
        kl = algos.kl_penalty(old_logprobs, ref_logprobs, algorithm.kl_penalty)
        rewards = algos.token_rewards(rollouts.scores, lengths, kl, self.kl_coef)
        current_kl = algos.mean_sequence_kl(kl, lengths)
        metrics = {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": self.kl_coef}
        control = algorithm.kl_ctrl
        if control.type == "adaptive":
            self.kl_coef = algos.adaptive_kl_coef(self.kl_coef, current_kl, len(lengths), control.target_kl,
                                                  control.horizon)
        return rewards, metrics


async def none(value=None):
    """An awaitable of ``value``, for a stage a run does not have."""
    return value


def make_batch(prompts: list[list[int]], responses: list[list[int]]) -> SequenceBatch:
    prompt_ids, prompt_lens = join_ragged([torch.tensor(p) for p in prompts], torch.int64)
    response_ids, response_lens = join_ragged([torch.tensor(r) for r in responses], torch.int64)
    return SequenceBatch(prompt_ids, prompt_lens, response_ids, response_lens)
