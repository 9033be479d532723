"""The PPO loop of one run (with a critic and GAE, or any estimator the coordinator registered), driven by the
coordinator.

Choices:
- The rollout engines, the trainer roles (actor, critic, reference) and the
  reward services are remote; this loop only moves batches between them and
  records what happened.
- A step: prompts -> n responses each (spread over the rollout replicas) ->
  scores (spread over the reward replicas; with DAPO dynamic sampling, groups
  whose scores are all equal are dropped and more prompts generated) -> old
  logprobs (where the update needs them: actor.recompute_old_log_prob; an
  update that is one optimizer step over the batch takes its own, and reports
  their mismatch with the rollout's), reference logprobs and values,
  concurrently -> token rewards
  (minus the KL penalty when it goes into the reward) -> advantages (the run's estimator, by its name in
  ``algo_registry``; remax's greedy responses are generated and scored beside the samples) ->
  critic and actor updates, concurrently -> weight sync trainer -> every
  rollout -> metrics. ``train`` reads as those stages, one call each; the generation side (prompts to scored
  batches) is the ``Producer``'s (producer.py), which the pipeline asks for each step's batch.
- Before the first step the run loads its roles everywhere, opens the weight
  channel, runs the optional supervised warm start, and syncs, so every
  rollout serves exactly the trainer's weights from step 1 on.
- Rollouts come and go (``RolloutSet``): one that fails mid-step has its
  shard redone on the others, newcomers are taken in at step boundaries with
  the current weights, and each shard must come back generated with them.
  Reward services too (``RewardSet``), and can be swapped mid-run.
- Sampling seeds come from (trainer.seed, step, round, prompt index), so a
  prompt's samples do not depend on which replica served it.
- Generation runs ahead of training by up to trainer.async_.max_staleness
  steps (``Pipeline``): the batch of step s is generated (and scored) once
  step s-1-K is updated and synced, so every sample was drawn from weights
  at most K versions older than those it is trained from; each sample
  carries the versions of its first and last tokens (they differ where
  new weights came in while it was sampled, partial_rollout keep; its
  staleness counts from the first), staleness is a metric, and a sample older than K
  (which the pipeline never produces) would be dropped with its group and
  counted. K = 0 is the synchronous loop, step for step.
- A batch's scores may still be coming when its training begins (producer.py): the actor's and reference's
  logprobs and the critic's values, which need none, are asked beside the reward services.
- CPU work on whole batches (decoding responses for the reward services,
  advantages) runs on a worker thread: the event loop stays free for the
  calls in flight, generation ahead among them.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, NamedTuple, Protocol

import torch

from services import algos
from services.algo_registry import EstimatorInputs, EstimatorParams
from services.estimators import compute_advantages
from services.common.sequences import SequenceBatch
from services.common.timing import StageTimer
from services.common.errors import FailedPrecondition
from services.coordinator.agent.agent_loop import AgentLoop, episode_row
from services.coordinator.agent.gateway.server import run_gateway
from services.coordinator.fleet.env_set import EnvProbe, EnvSet
from services.coordinator.step.checkpointer import CheckpointNotices, Checkpointer
from services.coordinator.fleet.clients import TrainerClient
from services.run.data import Prompt
from services.coordinator.step.sampler import PromptSampler
from services.coordinator.step.samples import step_records
from services.coordinator.step.producer import Produced, Producer
from services.coordinator.step.generation import Rollouts
from services.coordinator.step.metrics import data_metrics, throughput
from services.coordinator.step.pipeline import Pipeline
from services.coordinator.fleet.reward_set import RewardSet, probe_samples
from services.coordinator.fleet.rollout_set import RolloutSet
from services.coordinator.fleet.targets import ServiceTarget
from services.coordinator.settings import LoopSettings
from services.coordinator.store import Checkpoint
from services.coordinator.step.validation import ValidationNotices, Validations
from services.coordinator.step.warm_start import WarmStart, WarmStartProgress, warm_start_rows


class Reporter(CheckpointNotices, ValidationNotices, Protocol):
    """Where the loop reports; besides what its checkpoints and validations report (``log``, ``checkpoint``,
    ``damaged``, ``disk_waiting``, ``waiting``, ``validation``):"""

    async def step(self, step: int, metrics: dict[str, float]) -> None:
        """A step finished with these metrics (returns once they are recorded)."""

    async def samples(self, step: int, records: list[dict]) -> None:
        """Step ``step``'s responses with their lineage (samples.step_records), to keep (with
        trainer.rollout_data_dir set; written on a worker thread, held while the disk refuses them)."""


@dataclass
class Trainers:
    """The run's trainer roles; roles placed on the same trainer share one client."""

    actor: TrainerClient
    critic: TrainerClient | None
    ref: TrainerClient | None

    def roles(self) -> dict[TrainerClient, list[str]]:
        roles: dict[TrainerClient, list[str]] = {}
        for role, client in (("actor", self.actor), ("critic", self.critic), ("ref", self.ref)):
            if client is not None:
                roles.setdefault(client, []).append(role)
        return roles


class Evaluated(NamedTuple):
    """What the update needs from the trainers, all [T] over the batch's response tokens."""

    old_logprobs: torch.Tensor | None  # the actor's, before the update (None: the update takes its own)
    ref_logprobs: torch.Tensor | None  # the reference's (None: the run has no reference)
    values: torch.Tensor | None  # the critic's (None: the run has no critic)


class Estimate(NamedTuple):
    """Token rewards and what the estimator made of them, all [T]."""

    rewards: torch.Tensor  # scores on the last tokens, minus the KL penalty when it goes into the reward
    advantages: torch.Tensor
    returns: torch.Tensor
    metrics: dict[str, float]  # of the KL penalty in the reward


class Updates(NamedTuple):
    """What the updates of a step did."""

    metrics: dict[str, float]  # the actor's and the critic's
    version: int | None  # the actor's new weight version (None: only the critic was updated)


class Training(NamedTuple):
    """What only a run that trains has: its trainers, its warm start, its checkpoints and its batches."""

    trainers: Trainers
    warm_start: WarmStart
    checkpoints: Checkpointer
    producer: Producer


class PPOLoop:
    def __init__(self, *, run_id: str, settings: LoopSettings, config_yaml: str, trainers: Trainers | None,
                 rollout_set: RolloutSet, reward_set: RewardSet, env_set: EnvSet | None, prompts: list[Prompt],
                 val_prompts: list[Prompt], tokenizer, reporter: Reporter, should_stop: Callable[[], bool],
                 checkpoint_dir: Path):
        """``config_yaml``: the run config as the trainers load it; ``trainers``: None for a run that only
        validates; ``env_set``: a multi-turn run's env services (None: one response per prompt); ``tokenizer``:
        the model's, to decode responses for the reward services and encode the warm start's targets."""
        self.run_id, self.settings, self.config_yaml = run_id, settings, config_yaml
        self.rollout_set, self.reward_set, self.env_set = rollout_set, reward_set, env_set
        self.agent = AgentLoop(rollout_set=rollout_set, env_set=env_set, settings=settings.agent, tokenizer=tokenizer,
                               notices=reporter, gateway=run_gateway(run_id, settings.agent, tokenizer)) \
            if settings.agent is not None and env_set is not None else None
        warm_prompts, self.prompts = warm_start_rows(settings, prompts)  # the warm start's rows and RL's
        self.reporter, self.should_stop, self.timeout = reporter, should_stop, settings.rpc_timeout_s
        self.kl_coef = settings.kl_in_reward.initial_coef if settings.kl_in_reward else 0.0
        self.validations = Validations(settings=settings.validation, total_steps=settings.total_steps,
                                       prompts=val_prompts, rollout_set=rollout_set, reward_set=reward_set,
                                       agent=self.agent, tokenizer=tokenizer, notices=reporter, timeout_s=self.timeout)
        self.training: Training | None = None  # a run that only validates draws no batch, saves no checkpoint
        if trainers is not None:
            sampler = PromptSampler(len(self.prompts), settings.batch_size, settings.shuffle, seed=settings.seed)
            self.training = Training(
                trainers=trainers,
                warm_start=WarmStart(settings=settings, actor=trainers.actor, prompts=warm_prompts,
                                     tokenizer=tokenizer, notices=reporter, timeout_s=self.timeout,
                                     should_stop=should_stop),
                checkpoints=Checkpointer(run_id=run_id, roles=trainers.roles(), actor=trainers.actor, sampler=sampler,
                                         reward_set=reward_set, env_set=env_set, notices=reporter,
                                         should_stop=should_stop, folder=checkpoint_dir,
                                         keep=settings.checkpoints_kept, timeout_s=self.timeout,
                                         probe=rollout_set.probe),
                producer=Producer(settings=settings, prompts=self.prompts, sampler=sampler, rollout_set=rollout_set,
                                  reward_set=reward_set, agent=self.agent, tokenizer=tokenizer, notices=reporter))

    def trained(self) -> Training:
        """The run's training side; FailedPrecondition in a run that only validates (which never asks)."""
        if self.training is None:
            raise FailedPrecondition("a run that only validates has no trainers, warm start or checkpoints")
        return self.training

    @property
    def trainers(self) -> Trainers:
        return self.trained().trainers

    @property
    def checkpoints(self) -> Checkpointer:
        return self.trained().checkpoints

    async def run(self, resume: Checkpoint | None = None) -> bool:
        """Set up (from ``resume`` if given), then train until the last step or a stop request, checkpointing
        every trainer.save_freq steps and at a stop (one asked during the warm start lands at its next step
        boundary: its weights, optimizer and progress, as step 0, so that a resume goes on from there and does not
        teach again what it taught), and validating when asked; True if every step ran. A run that only validates
        does that and ends."""
        settings, validation = self.settings, self.settings.validation
        if validation is not None and validation.only:
            await self.follow_envs()
            await self.rollout_set.load()
            self.validations.start(0)
            await self.validations.finish()
            return True
        warm_start_began = await self.set_up(resume)
        checkpoints, validations = self.checkpoints, self.validations
        first, last = checkpoints.saved_step + 1, settings.total_steps
        if self.should_stop():
            if warm_start_began:  # stopped in (or right after) the warm start: keep what it taught, and where it was
                checkpoints.drawn(0, checkpoints.data_state())
                await checkpoints.save(0, self.kl_coef, self.trained().warm_start.progress)
            return False
        if validation is not None and validation.before_train and checkpoints.saved_step == 0:
            validations.start(0)                                          # the starting weights
        await self.boundary(first)
        pipeline = Pipeline(self.trained().producer.produce, checkpoints.data_state, first, last_step=last,
                            max_staleness=settings.max_staleness)
        pipeline.start()
        try:
            for step in range(first, last + 1):
                timer = StageTimer()
                ahead = await pipeline.next(step)                          # generated (ahead, when K > 0)
                metrics = await self.train(step, ahead.batch, timer)      # trained, synced
                checkpoints.drawn(step, ahead.data_state)
                metrics["perf/rollout_idle_fraction"] = pipeline.idle_fraction(since=timer.started)
                await self.reporter.step(step, metrics)
                if warning := mismatch_warning(step, metrics, settings.mismatch_kl_warning):
                    self.reporter.log(warning, kind="warning")
                if validations.due(step):
                    validations.start(step)                               # beside the next step's work
                if settings.save_freq and step % settings.save_freq == 0:
                    await checkpoints.save(step, self.kl_coef)
                if self.should_stop() and step < last:
                    await validations.finish()
                    if step > checkpoints.saved_step:
                        await checkpoints.save(step, self.kl_coef)
                    return False
                if step < last:
                    await self.boundary(step + 1)
                await pipeline.complete(step)                             # later batches may be begun
            await validations.finish()
        finally:
            await pipeline.close()
            await self.trained().producer.close()
            await validations.cancel()
        return True

    async def train(self, step: int, produced: Produced, timer: StageTimer) -> dict[str, float]:
        """The training side of a step: logprobs, advantages, updates, weight sync; returns the step's metrics."""
        served = self.rollout_set.served                                            #    the weights updated from
        keep, staleness = self.within_staleness(produced.rollouts)                  # 1. responses
        rollouts = produced.rollouts.keep_prompts(keep) if keep is not None else produced.rollouts
        self.rollout_set.draw_probe(rollouts.batch, rollouts.group_ids)             #    (the weight check's probe)
        async with self.rollouts_asleep(timer):                                     #    (the GPU is the trainer's)
            scored, evaluated = await asyncio.gather(
                produced.scored(),                                                  #    their scores (still coming)
                self.evaluate(rollouts, step, timer))                               # 2. what the update needs
            rollouts = scored.keep_prompts(keep) if keep is not None else scored
            timer.seconds.update(produced.seconds)
            estimate = await self.estimate(rollouts, evaluated, timer)              # 3. rewards and advantages
            updates, _ = await asyncio.gather(
                self.update(rollouts, evaluated, estimate, step=step, timer=timer),  # 4. critic and actor updates
                self.keep_samples(step, rollouts, served, estimate=estimate))       #    (and the samples' lineage)
        await self.sync_weights(updates, timer)                                     # 5. rollouts serve the new weights
        metrics = {**updates.metrics, **estimate.metrics, **produced.metrics, **staleness,
                   **self.rollout_set.probe_metrics, **timer.metrics(),
                   **{f"perf/rollout/{key}": value for key, value in self.rollout_set.memory.items()}}
        return {**metrics, **batch_metrics(rollouts, evaluated, estimate, updates=updates,
                                           step_s=metrics["timing_s/step"], devices=self.rollout_set.devices)}

    # ------------------------------------------------------------------ the stages of a step

    @contextlib.asynccontextmanager
    async def rollouts_asleep(self, timer: StageTimer):
        """Colocated (actor_rollout_ref.rollout.free_cache_engine): the rollouts free their GPU memory for the
        body of the ``with`` and take it back after; otherwise nothing."""
        if not self.settings.sleep_rollouts:
            yield
            return
        await self.validations.finish()
        with timer("rollout_sleep"):
            await self.rollout_set.sleep()
        yield
        with timer("rollout_wake_up"):
            await self.rollout_set.wake_up()

    async def evaluate(self, rollouts: Rollouts, step: int, timer: StageTimer) -> Evaluated:
        """Old logprobs (actor), reference logprobs and values (critic), concurrently."""
        batch = rollouts.batch
        one_sample_each = len(batch) == len(rollouts.last_rows)
        return Evaluated(*await asyncio.gather(self.old_logprobs(batch, one_sample_each, step, timer=timer),
                                               self.ref_logprobs(batch, step, timer),
                                               self.values(batch, step, timer)))

    async def old_logprobs(self, batch: SequenceBatch, one_sample_each: bool, step: int,
                           *, timer: StageTimer) -> torch.Tensor | None:
        """None where the step's actor update is one optimizer step over the batch (recompute_old_logprobs off):
        it takes its own logprobs, detached, as pi_old. A step that does not update the actor (critic warmup)
        computes them, for the mismatch metrics; so does one whose trajectories went on in new samples
        (``one_sample_each`` False): its rows outnumber the trajectories that the mini-batch was sized for, so
        its update may be more than one optimizer step."""
        if not self.settings.recompute_old_logprobs and step > self.settings.critic_warmup and one_sample_each:
            return None
        with timer("old_log_prob"):
            return await self.trainers.actor.compute_log_probs(batch, step, self.timeout)

    async def ref_logprobs(self, batch: SequenceBatch, step: int, timer: StageTimer) -> torch.Tensor | None:
        if self.trainers.ref is None:
            return None
        with timer("ref"):
            return await self.trainers.ref.compute_log_probs(batch, step, self.timeout, role="ref")

    async def values(self, batch: SequenceBatch, step: int, timer: StageTimer) -> torch.Tensor | None:
        if self.trainers.critic is None:
            return None
        with timer("values"):
            return await self.trainers.critic.compute_values(batch, step, self.timeout)

    async def estimate(self, rollouts: Rollouts, evaluated: Evaluated, timer: StageTimer) -> Estimate:
        """Token rewards and advantages, on a worker thread; then the adaptive KL coefficient moves."""
        with timer("adv"):
            estimate = await asyncio.to_thread(estimate_advantages, self.settings, self.kl_coef, rollouts,
                                               evaluated=evaluated)
        control = self.settings.kl_in_reward
        if control is not None and control.adaptive:
            self.kl_coef = algos.adaptive_kl_coef(self.kl_coef, estimate.metrics["actor/reward_kl_penalty"],
                                                  len(rollouts.last_rows), target=control.target_kl,
                                                  horizon=control.horizon)
        return estimate

    async def keep_samples(self, step: int, rollouts: Rollouts, served: int, *, estimate: Estimate) -> None:
        """With trainer.rollout_data_dir: every response of the step with its lineage, to the reporter (made on a
        worker thread: the records are the size of the batch)."""
        if self.settings.keep_samples:
            records = await asyncio.to_thread(step_records, step, rollouts, served, advantages=estimate.advantages)
            await self.reporter.samples(step, records)

    async def update(self, rollouts: Rollouts, evaluated: Evaluated, estimate: Estimate, *, step: int,
                     timer: StageTimer) -> Updates:
        """The critic's and the actor's updates, concurrently (the actor's from step critic_warmup + 1 on)."""
        critic_metrics, (actor_metrics, version) = await asyncio.gather(
            self.update_critic(rollouts.batch, evaluated, estimate, step=step, timer=timer),
            self.update_actor(rollouts, evaluated, estimate, step=step, timer=timer))
        return Updates({**actor_metrics, **critic_metrics}, version)

    async def update_critic(self, batch: SequenceBatch, evaluated: Evaluated, estimate: Estimate, *, step: int,
                            timer: StageTimer) -> dict[str, float]:
        critic = self.trainers.critic
        if critic is None or evaluated.values is None:  # values come with a critic
            return {}
        with timer("update_critic"):
            return await critic.update_critic(batch, evaluated.values, estimate.returns, step=step,
                                             timeout=self.timeout)

    async def update_actor(self, rollouts: Rollouts, evaluated: Evaluated, estimate: Estimate, *, step: int,
                           timer: StageTimer) -> tuple[dict[str, float], int | None]:
        if step <= self.settings.critic_warmup:
            return {}, None
        # the rollout's logprobs: for the rollout correction, and for the mismatch metrics of an update that takes
        # its own old logprobs (the trainer computes them then)
        needs_rollout = self.settings.rollout_correction or evaluated.old_logprobs is None
        rollout_logprobs = rollouts.logprobs if needs_rollout else None
        with timer("update_actor"):
            return await self.trainers.actor.update_actor(
                rollouts.batch, evaluated.old_logprobs, estimate.advantages, ref_logprobs=evaluated.ref_logprobs,
                step=step, timeout=self.timeout, rollout_logprobs=rollout_logprobs)

    async def sync_weights(self, updates: Updates, timer: StageTimer) -> None:
        """Every rollout serves the actor's new weights (nothing to send when only the critic was updated)."""
        if updates.version is None:
            return
        if self.validations.in_progress is not None:
            with timer("wait_validation"):  # the trainer's time lost to a validation still generating
                await self.validations.finish()
        with timer("update_weights"):
            await self.rollout_set.sync(updates.version)
        timer.seconds["rollout_pause"] = self.rollout_set.pause_s
        if self.rollout_set.probe is not None:
            timer.seconds["weight_probe"] = self.rollout_set.probe_s  # (within update_weights)

    def within_staleness(self, rollouts: Rollouts) -> tuple[list[int] | None, dict[str, float]]:
        """The prompts (indices) whose every sample is at most trainer.async_.max_staleness versions older than
        the weights the update starts from (prompts with an older sample are dropped, and counted; None: every
        prompt is kept), and the staleness metrics (``staleness``)."""
        limit = self.settings.max_staleness
        keep, metrics = staleness(rollouts, served=self.rollout_set.served, limit=limit)
        if len(keep) == len(rollouts.prompts):
            return None, metrics
        if not keep:
            raise RuntimeError(f"every sample of the batch is more than {limit} weight versions old")
        self.reporter.log(f"dropped {metrics['training/off_policy/dropped_samples']:.0f} samples more than {limit} "
                          f"weight versions old")
        return keep, metrics

    # ------------------------------------------------------------------ set-up and boundaries

    async def set_up(self, resume: Checkpoint | None) -> bool:
        """Load the roles and models everywhere, open the weight channel, warm start (or restore, and go on with
        a warm start stopped part way), and sync; True if this went through (part of) the warm start."""
        await self.follow_envs()
        await asyncio.gather(
            *(trainer.init_run(self.run_id, self.config_yaml, roles, seed=self.settings.seed, timeout=self.timeout)
              for trainer, roles in self.trainers.roles().items()),
            self.rollout_set.form(),
        )
        if self.settings.sleep_rollouts:
            await self.rollout_set.wake_up()  # one an earlier attempt left asleep
        tools = self.env_set.tools(self.agent.settings.environment) if self.agent and self.env_set else ()
        version, progress = 0, self.trained().warm_start.progress  # a new run: none taught yet
        if resume is not None:
            restored = await self.checkpoints.restore(resume)
            version, self.kl_coef = restored.version, restored.kl_coef
            progress = restored.warm_start or WarmStartProgress.done(self.settings.warm_start_steps)
        warm_start = progress.taught < self.settings.warm_start_steps
        if warm_start:
            version = await self.trained().warm_start.run(tools, progress, version)
        await self.rollout_set.sync(version)
        return warm_start

    async def boundary(self, step: int) -> None:
        """Before step ``step`` is generated: apply a reward swap, follow the reward, env and rollout replicas."""
        await self.reward_set.refresh(step)
        await self.follow_envs()
        await self.rollout_set.refresh()

    async def follow_envs(self) -> None:
        """A multi-turn run: follow its env replicas (waiting for one), which must host its environment."""
        if self.agent is not None and self.env_set is not None:
            await self.env_set.refresh()
            self.env_set.tools(self.agent.settings.environment)  # ValueError naming what they host

    async def swap_reward(self, target: ServiceTarget) -> list[str]:
        """Probe ``target``'s reward services on the run's rows; if every one scores the probe, they score from
        the next step boundary on (``RewardSet.swap``). Returns their addresses."""
        return await self.reward_set.swap(target, probe_samples(self.prompts))

    async def swap_env(self, target: ServiceTarget) -> list[str]:
        """A multi-turn run: probe ``target``'s env services (each must host the run's environment and open and
        close an episode of it on one of the run's rows); if every one passes, the batches begun from the next
        step boundary on run their episodes there (``EnvSet.swap``). Returns their addresses."""
        if self.agent is None or self.env_set is None:
            raise FailedPrecondition("the run is not multi-turn (actor_rollout_ref.rollout.multi_turn.enable is "
                                     "off): it has no env services to swap")
        settings, row = self.agent.settings, episode_row((self.prompts or self.validations.prompts)[0])
        return await self.env_set.swap(target, EnvProbe(settings.environment, row, settings.max_parallel_calls))


def estimate_advantages(settings: LoopSettings, kl_coef: float, rollouts: Rollouts, *,
                        evaluated: Evaluated) -> Estimate:
    """Scores on the last (model) tokens (minus ``kl_coef`` times the KL penalty when it goes into the reward), and
    the estimator's advantages and returns, on the model tokens of the batch's loss mask where it has one.

    The estimator sees trajectories (``Rollouts.by_trajectory``): a multi-turn trajectory that went on in new
    samples is one sequence of its samples' tokens with one score on its last model token, one member of its
    prompt's group, so each of its samples' model tokens gets the trajectory's advantage (GAE: the advantages
    of one episode, whose values the critic gave each sample's tokens)."""
    trajectories, kl_in_reward, estimator = rollouts.by_trajectory(), settings.kl_in_reward, settings.estimator
    lengths, mask = trajectories.response_lens, rollouts.batch.loss_mask
    if kl_in_reward is None:
        rewards, metrics = algos.token_rewards(trajectories.scores, lengths, mask=mask), {}
    else:
        if evaluated.old_logprobs is None or evaluated.ref_logprobs is None:  # the settings ask for both then
            raise ValueError("algorithm.use_kl_in_reward needs the actor's old logprobs and the reference's")
        kl = algos.kl_penalty(evaluated.old_logprobs, evaluated.ref_logprobs, kl_in_reward.estimator)
        rewards = algos.token_rewards(trajectories.scores, lengths, kl, kl_coef=kl_coef, mask=mask)
        metrics = {"actor/reward_kl_penalty": algos.mean_sequence_kl(kl, lengths, mask),
                   "actor/reward_kl_penalty_coeff": kl_coef}
    inputs = EstimatorInputs(rewards=rewards, lengths=lengths, group_ids=trajectories.group_ids, mask=mask,
                             values=evaluated.values, baselines=trajectories.baselines)
    advantages = compute_advantages(estimator.name, inputs,
                                    EstimatorParams(estimator.gamma, estimator.lam, estimator.norm_by_std))
    return Estimate(rewards=rewards, advantages=advantages.advantages, returns=advantages.returns, metrics={**metrics,
                                                                                                            **advantages.metrics})


def batch_metrics(rollouts: Rollouts, evaluated: Evaluated, estimate: Estimate, *, updates: Updates,
                  step_s: float, devices: int) -> dict[str, float]:
    """verl's data metrics of the step's batch (by trajectory: a multi-turn one's samples together), its tokens
    (every sample's) and their throughput per device (``devices``: those the run computes on), and the weight
    version trained."""
    batch, trajectories = rollouts.batch, rollouts.by_trajectory()
    tokens = batch.num_response_tokens + int(batch.prompt_lens.sum())
    return {**data_metrics(scores=trajectories.scores, rewards=estimate.rewards, advantages=estimate.advantages,
                           returns=estimate.returns, values=evaluated.values, response_lens=trajectories.response_lens,
                           prompt_lens=trajectories.prompt_lens, truncated=trajectories.truncated,
                           rollout_logprobs=rollouts.logprobs, old_logprobs=evaluated.old_logprobs,
                           loss_mask=batch.loss_mask),
            "perf/total_num_tokens": float(tokens), "perf/throughput": throughput(tokens, step_s, devices),
            "perf/devices": float(devices),
            "training/weight_version": float(-1 if updates.version is None else updates.version)}


def mismatch_warning(step: int, metrics: Mapping[str, float], limit: float | None) -> str | None:
    """What to report of a step whose rollout/trainer mismatch KL (training/rollout_mismatch_kl, present when the
    update had the rollouts' logprobs) is over ``limit``: the trainer does not give the sampled tokens the
    probabilities the rollouts sampled them with, so the update's importance ratios are off, though the weight
    check may pass (it scores a probe of its own, not the batch). None when it is within it, or not measured."""
    kl = metrics.get("training/rollout_mismatch_kl")
    if limit is None or kl is None or kl <= limit:
        return None
    spanning = metrics.get("training/off_policy/samples_spanning_swap", 0.0)
    return (f"step {step}: rollout/trainer mismatch KL {kl:.3g}, over {limit:g} "
            "(actor_rollout_ref.rollout.weight_check.mismatch_kl_warning): the trainer disowns the tokens the rollouts "
            f"sampled, and the update's ratios are off; {spanning:.0f} samples spanned a weight swap")


def staleness(rollouts: Rollouts, *, served: int, limit: int) -> tuple[list[int], dict[str, float]]:
    """The prompts whose every sample is at most ``limit`` versions older than ``served`` (the weights the update
    starts from), and the staleness metrics. A sample's staleness counts from its first token's version; those whose
    later tokens came from newer weights (partial_rollout keep) are counted as spanning a swap."""
    ages = (served - rollouts.versions).float()
    keep = rollouts.prompts_where_every_sample(ages <= limit)
    dropped = ~torch.isin(rollouts.group_ids, torch.tensor(keep, dtype=torch.int64))
    spanning = (rollouts.last_versions > rollouts.versions).sum()
    return keep, {"rollout/weight_version": float(rollouts.versions.min()),
                  "training/off_policy/staleness/mean": float(ages.mean()),
                  "training/off_policy/staleness/max": float(ages.max()),
                  "training/off_policy/dropped_samples": float(dropped.sum()),
                  "training/off_policy/samples_spanning_swap": float(spanning)}
