"""The coordinator's plain settings of a run, built once from its RunConfig.

The loop, the rollout set and the reward set take these instead of reading the nested config, as the
trainer's ops take its ``trainer.settings.RunSettings``: each value is named for what the code does with it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from services.algo_registry import ADV_ESTIMATORS
from services.run.checks import is_mixture_of_experts
from services.run.config import RunConfig
from services.run.lora import served_lora_rank


@dataclass(frozen=True, kw_only=True)
class Sampling:
    """What every Generate call of a run asks for."""

    n: int  # responses per prompt
    temperature: float
    top_p: float
    max_new_tokens: int
    stop_token_ids: tuple[int, ...]  # besides EOS
    routed_experts: bool = False  # also the experts each token was routed to (routing replay)


@dataclass(frozen=True, kw_only=True)
class Estimator:
    """The advantage estimator and its parameters (services/algo_registry.ADV_ESTIMATORS)."""

    name: str  # as registered: gae, grpo, rloo, ..., or a user's
    gamma: float
    lam: float
    norm_by_std: bool  # GRPO divides by the group's std (False: Dr. GRPO)
    greedy_baseline: bool = False  # it needs a greedy response to each prompt, scored (remax)


@dataclass(frozen=True, kw_only=True)
class KLInReward:
    """The KL penalty subtracted from every token's reward, and how its coefficient moves."""

    estimator: str  # kl/k1, abs, mse/k2, low_var_kl/k3
    initial_coef: float
    adaptive: bool  # move the coefficient toward target_kl over horizon samples
    target_kl: float
    horizon: int


@dataclass(frozen=True, kw_only=True)
class ValidationSettings:
    """When and how a run validates on its held-out prompts."""

    sampling: Sampling
    seed: int  # the same for every validation of a run, so that equal weights give equal samples
    test_freq: int  # validate every this many steps and after the last (<= 0: not during training)
    before_train: bool  # validate the starting weights (not again after a resume)
    only: bool  # validate the model folder and finish: no training


@dataclass(frozen=True, kw_only=True)
class AgentSettings:
    """How a multi-turn run's trajectories go (actor_rollout_ref.rollout.multi_turn)."""

    environment: str  # which environment of the env services runs the episodes
    max_assistant_turns: int | None  # None: as many as the response length holds
    max_user_turns: int | None  # replies; None: no bound but the response length
    max_parallel_calls: int  # tool calls run of one model turn (the env service's own bound applies too)
    max_reply_tokens: int  # of one tool or environment reply
    truncate_side: str  # the side of an over-long reply that is kept: left, right, middle
    env_reward_weight: float  # score = reward service's + this times the environment's step rewards
    max_response_length: int  # every token after the prompt, the model's and the replies'
    max_prompt_length: int  # of the prompt as rendered with the environment's tools and opening messages
    calls_in_flight: int  # Generate calls at once per rollout replica (hf: 1, its engine runs one at a time)
    gateway_host: str = "127.0.0.1"  # the run's OpenAI-compatible endpoint, for an environment of users' agents
    gateway_port: int = 0  # 0: one the system picks
    gateway_max_n: int = 8  # completions one call to it may ask for


@dataclass(frozen=True, kw_only=True)
class LoopSettings:
    """What the PPO loop of one run does each step."""

    total_steps: int
    save_freq: int  # checkpoint every this many steps (0: only when stopped; verl's -1 is 0 here)
    checkpoints_kept: int | None  # the run keeps this many newest checkpoints (None: all)
    max_staleness: int  # generation may run this many weight versions ahead of training
    seed: int
    rpc_timeout_s: float  # of each training, generation and scoring call
    batch_size: int  # prompts per step
    shuffle: bool
    sampling: Sampling
    estimator: Estimator
    kl_in_reward: KLInReward | None  # None: no KL in the reward
    critic_warmup: int  # steps that update only the critic
    recompute_old_logprobs: bool  # a logprob pass before each actor update (False: the update's own gives pi_old)
    rollout_correction: bool  # send the rollout's logprobs with each actor update (importance weights)
    sleep_rollouts: bool  # rollouts free their GPU memory while the trainer works (colocated)
    filter_groups: bool  # DAPO dynamic sampling: drop groups whose scores are all equal
    max_gen_rounds: int  # generation rounds per step when filtering
    warm_start_steps: int
    warm_start_batch_size: int
    warm_start_own_rows: bool  # the warm start teaches rows RL never draws
    validation: ValidationSettings | None  # None: the run has no held-out data
    keep_samples: bool  # report each step's samples with their lineage (trainer.rollout_data_dir)
    mismatch_kl_warning: float | None  # a step whose rollout/trainer mismatch KL is over this is reported
    agent: AgentSettings | None  # None: one response per prompt; else multi-turn trajectories


@dataclass(frozen=True, kw_only=True)
class WeightCheckSettings:
    """The weight check after every sync (actor_rollout_ref.rollout.weight_check)."""

    sequences: int  # in the probe
    tolerance_mean: float | None  # None: the figure measured for the rollout's engine and dtype
    tolerance_max: float | None
    top_k: int = 20  # next tokens at each probe position whose distributions are compared
    tolerance_topk_kl: float | None = None
    mixture_of_experts: bool = False  # the model routes tokens to experts: its top-k KL has a tolerance of its own


@dataclass(frozen=True, kw_only=True)
class RolloutSetSettings:
    """How a run's rollouts load its model and receive its weights."""

    model_path: str
    dtype: str
    allow_pickle: bool  # load pickled weights (actor_rollout_ref.model.allow_pickle)
    group: str  # the placement's rollout group
    backend: str  # weight channel transport: gloo, nccl, cuda_ipc, or auto (resolved when a channel forms)
    channel_timeout_s: float  # joining a channel, and each broadcast
    rpc_timeout_s: float
    bucket_bytes: int
    partial_rollout: str  # what a swap does with the Generate calls in flight: finish, restart or keep
    lora_rank: int  # a LoRA run's largest adapter rank (its syncs bring adapters); 0: full weights (or merged ones)
    adapter_versions: int  # adapter versions a LoRA rollout keeps loaded (max_staleness + 1); 0 without LoRA
    weight_check: WeightCheckSettings | None = None  # None: no check of the weights after a sync
    routed_experts: bool = False  # the rollouts record each token's routed experts (routing replay)


def loop_settings(config: RunConfig) -> LoopSettings:
    data, trainer, algorithm = config.data, config.trainer, config.algorithm
    rollout, warm_start = config.actor_rollout_ref.rollout, config.actor_rollout_ref.actor.warm_start
    control = algorithm.kl_ctrl
    kl_in_reward = KLInReward(estimator=algorithm.kl_penalty, initial_coef=control.kl_coef,
                              adaptive=control.type == "adaptive", target_kl=control.target_kl,
                              horizon=control.horizon) if algorithm.use_kl_in_reward else None
    return LoopSettings(
        total_steps=trainer.steps, save_freq=max(trainer.save_freq, 0),
        checkpoints_kept=checkpoints_kept(trainer.max_actor_ckpt_to_keep, trainer.max_critic_ckpt_to_keep,
                                          has_critic=config.use_critic),
        max_staleness=trainer.async_.max_staleness, seed=trainer.seed, rpc_timeout_s=trainer.rpc_timeout_s,
        batch_size=data.train_batch_size, shuffle=data.shuffle,
        sampling=Sampling(n=rollout.n, temperature=rollout.temperature, top_p=rollout.top_p,
                          max_new_tokens=data.max_response_length,
                          stop_token_ids=tuple(rollout.stop_token_ids), routed_experts=config.records_routes),
        estimator=Estimator(name=algorithm.adv_estimator, gamma=algorithm.gamma, lam=algorithm.lam,
                            norm_by_std=algorithm.norm_adv_by_std_in_grpo,
                            greedy_baseline=ADV_ESTIMATORS.get(algorithm.adv_estimator).greedy_baseline),
        kl_in_reward=kl_in_reward, critic_warmup=trainer.critic_warmup,
        recompute_old_logprobs=config.recomputes_old_log_prob,
        rollout_correction=config.use_rollout_correction, sleep_rollouts=rollout.free_cache_engine,
        filter_groups=algorithm.filter_groups.enable, max_gen_rounds=algorithm.filter_groups.max_num_gen_batches,
        warm_start_steps=warm_start.steps, warm_start_batch_size=warm_start.batch_size,
        warm_start_own_rows=warm_start.own_rows,
        validation=validation_settings(config), keep_samples=trainer.rollout_data_dir is not None,
        mismatch_kl_warning=rollout.weight_check.mismatch_kl_warning,
        agent=agent_settings(config),
    )


def agent_settings(config: RunConfig) -> AgentSettings | None:
    rollout = config.actor_rollout_ref.rollout
    turns = rollout.multi_turn
    if not turns.enable:
        return None
    return AgentSettings(
        environment=turns.environment, max_assistant_turns=turns.max_assistant_turns,
        max_user_turns=turns.max_user_turns, max_parallel_calls=turns.max_parallel_calls,
        max_reply_tokens=turns.max_tool_response_length,
        truncate_side=turns.tool_response_truncate_side, env_reward_weight=turns.env_reward_weight,
        max_response_length=config.data.max_response_length, max_prompt_length=config.data.max_prompt_length,
        calls_in_flight=1 if rollout.name == "hf" else 64, gateway_host=turns.gateway.host,
        gateway_port=turns.gateway.port, gateway_max_n=turns.gateway.max_n)


def checkpoints_kept(actor_bound: int | None, critic_bound: int | None, has_critic: bool) -> int | None:
    """How many step folders a run keeps (None: all), from verl's two bounds (None: keep all). A step folder
    holds both roles, so it goes only once each role's bound lets it: the larger bound, and None if either
    role keeps all; a run without a critic follows the actor's alone."""
    if not has_critic:
        return actor_bound
    if actor_bound is None or critic_bound is None:
        return None
    return max(actor_bound, critic_bound)


def validation_settings(config: RunConfig) -> ValidationSettings | None:
    if not config.data.val_files:
        return None
    trainer, val = config.trainer, config.actor_rollout_ref.rollout.val_kwargs
    sampling = Sampling(n=val.n, temperature=val.sampling_temperature, top_p=val.sampling_top_p,
                        max_new_tokens=config.data.max_response_length,
                        stop_token_ids=tuple(config.actor_rollout_ref.rollout.stop_token_ids))
    return ValidationSettings(sampling=sampling, seed=trainer.seed * 1_000_003 + 7, test_freq=trainer.test_freq,
                              before_train=trainer.val_before_train,
                              only=trainer.val_only)


def rollout_set_settings(config: RunConfig) -> RolloutSetSettings:
    model, trainer = config.actor_rollout_ref.model, config.trainer
    lora_rank = 0 if config.warm_start_trains_base else served_lora_rank(model)  # (then syncs bring full weights)
    return RolloutSetSettings(
        model_path=model.path, dtype=model.dtype, allow_pickle=model.allow_pickle, group=config.placement.rollout,
        backend=trainer.weight_sync_backend,
        channel_timeout_s=trainer.channel_timeout_s, rpc_timeout_s=trainer.rpc_timeout_s,
        bucket_bytes=trainer.weight_sync_bucket_mb << 20,
        partial_rollout=config.actor_rollout_ref.rollout.partial_rollout,
        lora_rank=lora_rank, adapter_versions=trainer.async_.max_staleness + 1 if lora_rank else 0,
        weight_check=weight_check_settings(config), routed_experts=config.records_routes,
    )


def weight_check_settings(config: RunConfig) -> WeightCheckSettings | None:
    check = config.actor_rollout_ref.rollout.weight_check
    if not check.enable:
        return None
    return WeightCheckSettings(sequences=check.probe_sequences, tolerance_mean=check.tolerance_mean,
                               tolerance_max=check.tolerance_max, top_k=check.top_k,
                               tolerance_topk_kl=check.tolerance_topk_kl,
                               mixture_of_experts=is_mixture_of_experts(config.actor_rollout_ref.model.path))


def check_algorithms_registered(config: RunConfig, trainer_losses: Mapping[str, Sequence[str]]) -> None:
    """Refuse a run whose advantage estimator this coordinator has not registered, or whose policy loss one of the
    actor's trainers (address -> the losses it registered) has not: ValueError naming the key and the names that
    are registered. A trainer that registered none (too old to say) is not asked; it refuses the run itself. An
    estimator that needs greedy baselines (remax) is refused on multi-turn runs: they are generated one turn."""
    estimator = ADV_ESTIMATORS.get(config.algorithm.adv_estimator)
    if estimator.greedy_baseline and config.actor_rollout_ref.rollout.multi_turn.enable:
        raise ValueError(f"algorithm.adv_estimator={config.algorithm.adv_estimator} compares each response with one "
                         "greedy single-turn response to its prompt; it cannot run with "
                         "actor_rollout_ref.rollout.multi_turn.enable")
    mode = config.actor_rollout_ref.actor.policy_loss.loss_mode
    for address, losses in sorted(trainer_losses.items()):
        if losses and mode not in losses:
            raise ValueError(f"actor_rollout_ref.actor.policy_loss.loss_mode={mode!r}: trainer {address} has no policy "
                             f"loss of that name; registered there: {', '.join(losses)}")


def check_within_rollout_limits(config: RunConfig, limits: Mapping[str, Mapping[str, int]]) -> None:
    """Refuse a run that would ask a rollout (address -> the limits it registered) for more than one Generate
    call may: ValueError naming the config key, the rollout and its limit's setting. Rollouts that say no
    limits (or are not up yet) refuse such a call themselves, at the run's first Generate."""
    rollout = config.actor_rollout_ref.rollout
    asks = [("actor_rollout_ref.rollout.n", rollout.n, "max_n"),
            ("data.max_response_length", config.data.max_response_length, "max_new_tokens")]
    if config.data.val_files:
        asks.append(("actor_rollout_ref.rollout.val_kwargs.n", rollout.val_kwargs.n, "max_n"))
    for address, said in sorted(limits.items()):
        for key, value, setting in asks:
            if setting in said and value > said[setting]:
                raise ValueError(f"{key} = {value} is over the limit of rollout {address}: {setting} = "
                                 f"{said[setting]}; lower {key}, or start the rollout with a larger {setting}")
