"""The run config: what a run trains, on what data, with which algorithm.

Key names follow verl where the concept is the same, so a verl user's
``data.train_batch_size=64`` or ``actor_rollout_ref.rollout.n=8`` means the
same thing here. Batch sizes are counted in prompts, as verl counts them.

This module holds the root, ``RunConfig``: its sections and the checks that
read across them. Each section has a module in services/run/sections/, as
verl's config is organised: data, actor_rollout_ref (with its larger parts,
actor and rollout, apart), critic, algorithm, trainer, and meshrl's own
placement; fsdp and optim are the parts that actor, reference and critic share.
"""

from __future__ import annotations

from pathlib import Path

import pydantic

from services.common.config import Section
from services.run.sections.actor_rollout_ref import ActorRolloutRefConfig
from services.run.sections.algorithm import GROUP_ESTIMATORS, AlgorithmConfig
from services.run.sections.critic import CriticConfig
from services.run.sections.data import DataConfig
from services.run.sections.placement import PlacementConfig
from services.run.sections.trainer import VERL_ONLY_LOGGERS, TrainerConfig


class RunConfig(Section):
    data: DataConfig = DataConfig()
    actor_rollout_ref: ActorRolloutRefConfig = ActorRolloutRefConfig()
    critic: CriticConfig = CriticConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    trainer: TrainerConfig = TrainerConfig()
    placement: PlacementConfig = PlacementConfig()

    @property
    def use_critic(self) -> bool:
        return self.critic.enable if self.critic.enable is not None else self.algorithm.adv_estimator == "gae"

    @property
    def use_reference(self) -> bool:
        return self.actor_rollout_ref.actor.use_kl_loss or self.algorithm.use_kl_in_reward

    @property
    def warm_start_trains_base(self) -> bool:
        """Whether a LoRA actor's warm start trains the full weights under its adapters (warm_start.full_weights)."""
        actor_rollout_ref = self.actor_rollout_ref
        warm_start = actor_rollout_ref.actor.warm_start
        return bool(actor_rollout_ref.model.lora_rank and warm_start.steps and warm_start.full_weights)

    @property
    def use_rollout_correction(self) -> bool:
        enable = self.algorithm.rollout_correction.enable
        return self.trainer.async_.max_staleness > 0 if enable == "auto" else enable

    @pydantic.model_validator(mode="after")
    def _batch_sizes_agree(self) -> RunConfig:
        batch = self.data.train_batch_size
        mini = self.actor_rollout_ref.actor.ppo_mini_batch_size
        if batch % mini:
            raise ValueError(
                f"data.train_batch_size ({batch}) must be a multiple of "
                f"actor_rollout_ref.actor.ppo_mini_batch_size ({mini})"
            )
        critic_mini = self.critic.ppo_mini_batch_size
        if critic_mini is not None and batch % critic_mini:
            raise ValueError(f"data.train_batch_size ({batch}) must be a multiple of critic.ppo_mini_batch_size "
                             f"({critic_mini})")
        estimator = self.algorithm.adv_estimator
        if estimator in GROUP_ESTIMATORS and self.actor_rollout_ref.rollout.n < 2:
            raise ValueError(f"algorithm.adv_estimator={estimator} needs actor_rollout_ref.rollout.n >= 2 "
                             "(groups of responses)")
        if estimator == "gae" and self.critic.enable is False:
            raise ValueError("algorithm.adv_estimator=gae needs a critic, but critic.enable is false")
        return self

    @property
    def old_log_prob_needed(self) -> str | None:
        """Why the actor's logprobs must be computed before its update; None: its one optimizer step's own
        forward pass gives them (actor.recompute_old_log_prob)."""
        actor, batch = self.actor_rollout_ref.actor, self.data.train_batch_size
        if actor.ppo_epochs > 1:
            return (f"actor_rollout_ref.actor.ppo_epochs is {actor.ppo_epochs}: the later epochs' ratios compare "
                    "with the weights before the update")
        if actor.ppo_mini_batch_size < batch:
            return (f"actor_rollout_ref.actor.ppo_mini_batch_size ({actor.ppo_mini_batch_size}) is below "
                    f"data.train_batch_size ({batch}): the later mini-batches' ratios compare with the weights "
                    "before the update")
        if self.algorithm.use_kl_in_reward:
            return "algorithm.use_kl_in_reward: the KL penalty enters the rewards, before the update"
        return None

    @property
    def recomputes_old_log_prob(self) -> bool:
        """Whether each actor update is preceded by a logprob pass (actor.recompute_old_log_prob resolved)."""
        chosen = self.actor_rollout_ref.actor.recompute_old_log_prob
        return self.old_log_prob_needed is not None if chosen is None else chosen

    @pydantic.model_validator(mode="after")
    def _old_log_prob_skipped_only_where_safe(self) -> RunConfig:
        needed = self.old_log_prob_needed
        if self.actor_rollout_ref.actor.recompute_old_log_prob is False and needed is not None:
            raise ValueError(f"actor_rollout_ref.actor.recompute_old_log_prob=false, but the update needs the old "
                             f"logprobs: {needed}; leave it null (computed only where needed) or set it true")
        return self

    @property
    def records_routes(self) -> bool:
        """Whether the rollouts record each token's routed experts (routing replay R3, or its agreement alone)."""
        rollout = self.actor_rollout_ref.rollout
        return rollout.enable_rollout_routing_replay or self.actor_rollout_ref.actor.router_replay.mode == "R3"

    @pydantic.model_validator(mode="after")
    def _routes_recorded_where_they_can_travel(self) -> RunConfig:
        rollout = self.actor_rollout_ref.rollout
        if self.records_routes and rollout.multi_turn.enable:
            raise ValueError("actor_rollout_ref.actor.router_replay.mode R3 (or rollout.enable_rollout_routing_replay) "
                             "with rollout.multi_turn.enable: a multi-turn trajectory does not carry routed experts "
                             "yet; turn one of them off")
        return self

    @pydantic.model_validator(mode="after")
    def _sleeping_rollouts_are_synchronous(self) -> RunConfig:
        if self.actor_rollout_ref.rollout.free_cache_engine and self.trainer.async_.max_staleness > 0:
            raise ValueError("actor_rollout_ref.rollout.free_cache_engine needs trainer.async_.max_staleness=0: "
                             "a sleeping rollout cannot generate ahead")
        return self

    @pydantic.model_validator(mode="after")
    def _trainer_layout_agrees(self) -> RunConfig:
        actor, rollout, critic = self.actor_rollout_ref.actor, self.actor_rollout_ref.rollout, self.critic
        ref = self.actor_rollout_ref.ref
        rollout_dynamic = rollout.log_prob_use_dynamic_bsz
        ref_dynamic = rollout_dynamic if ref.log_prob_use_dynamic_bsz is None else ref.log_prob_use_dynamic_bsz
        longest = self.data.max_prompt_length + self.data.max_response_length
        budgets = (
            ("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", actor.use_dynamic_bsz,
             actor.ppo_max_token_len_per_gpu),
            ("actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
             actor.use_dynamic_bsz if rollout_dynamic is None else rollout_dynamic,
             rollout.log_prob_max_token_len_per_gpu or actor.ppo_max_token_len_per_gpu),
            ("actor_rollout_ref.ref.log_prob_max_token_len_per_gpu", actor.use_dynamic_bsz if ref_dynamic is None
             else ref_dynamic, ref.log_prob_max_token_len_per_gpu or rollout.log_prob_max_token_len_per_gpu
             or actor.ppo_max_token_len_per_gpu),
            ("critic.ppo_max_token_len_per_gpu", critic.use_dynamic_bsz, critic.ppo_max_token_len_per_gpu),
            ("critic.forward_max_token_len_per_gpu", critic.use_dynamic_bsz,
             critic.forward_max_token_len_per_gpu or critic.ppo_max_token_len_per_gpu),
        )
        for field, dynamic, budget in budgets:
            if dynamic and budget < longest:
                raise ValueError(f"{field} ({budget}) must hold the longest sequence: data.max_prompt_length + "
                                 f"data.max_response_length = {longest}")
        held = (("actor_rollout_ref.actor.strategy", actor.strategy, "its fsdp_config", actor.fsdp_config),
                ("actor_rollout_ref.actor.strategy", actor.strategy, "actor_rollout_ref.ref.fsdp_config",
                 ref.fsdp_config or actor.fsdp_config),
                ("critic.strategy", critic.strategy, "critic.model.fsdp_config", critic.model.fsdp_config))
        for strategy_key, strategy, fsdp_key, fsdp in held:
            if strategy == "none" and fsdp.needs_fsdp:
                raise ValueError(f"{strategy_key}=none cannot do the mixed precision or parameter offload {fsdp_key} "
                                 "asks for: use fsdp2 or auto")
        return self

    def checkpoint_dir(self, run_dir: Path) -> Path:
        """Where the run's checkpoints go: trainer.default_local_dir (under ``run_dir`` if relative), or
        ``run_dir``/checkpoints."""
        chosen = self.trainer.default_local_dir
        return run_dir / "checkpoints" if chosen is None else run_dir / chosen  # an absolute one stays itself

    def samples_dir(self, run_dir: Path) -> Path | None:
        """Where the run's samples go: trainer.rollout_data_dir (under ``run_dir`` if relative); None: nowhere."""
        chosen = self.trainer.rollout_data_dir
        return None if chosen is None else run_dir / chosen  # an absolute one stays itself

    def steps_for(self, rows: int) -> RunConfig:
        """This config with trainer.total_training_steps set, ``rows`` the training prompts (total_epochs passes
        of rows // data.train_batch_size steps each)."""
        trainer = self.trainer
        if trainer.total_training_steps is not None or trainer.total_epochs is None:
            steps = trainer.steps
        else:
            steps = trainer.total_epochs * max(1, rows // self.data.train_batch_size)
        return self.model_copy(update={"trainer": trainer.model_copy(update={"total_training_steps": steps})})

    def notices(self) -> list[str]:
        """verl keys this config sets that meshrl accepts but does not act on, each with why (said once when a
        run starts)."""
        trainer, rollout, data = self.trainer, self.actor_rollout_ref.rollout, self.data
        notices = []
        unwritten = [name for name in trainer.logger if name in VERL_ONLY_LOGGERS]
        if unwritten:
            notices.append(f"trainer.logger={trainer.logger}: {', '.join(unwritten)} not written (meshrl writes the "
                           "console, tensorboard, wandb and mlflow; metrics.jsonl and the run DB always)")
        placement = {key: value for key, value in (("trainer.n_gpus_per_node", trainer.n_gpus_per_node),
                                                   ("trainer.nnodes", trainer.nnodes)) if value is not None}
        if placement:
            notices.append(", ".join(f"{key}={value}" for key, value in placement.items()) + ": verl's Ray "
                           "placement; meshrl uses the services that registered with the coordinator")
        if rollout.name in ("sglang", "sglang_async"):
            notices.append(f"actor_rollout_ref.rollout.name={rollout.name}: meshrl has no SGLang engine; the run "
                           "samples with the engine of its rollout services (their setting engine=hf|vllm)")
        if self.actor_rollout_ref.hybrid_engine is not None:
            notices.append(f"actor_rollout_ref.hybrid_engine={self.actor_rollout_ref.hybrid_engine}: verl's actor "
                           "and rollout in one process; meshrl's rollouts are services of their own (on the "
                           "trainer's GPUs with rollout.free_cache_engine)")
        if self.actor_rollout_ref.model.use_shm:
            notices.append("actor_rollout_ref.model.use_shm=True: meshrl loads the model folder where it is and "
                           "syncs adapters in memory, never through files")
        for key, verl_setting in (("load_format", rollout.load_format), ("layered_summon", rollout.layered_summon)):
            if verl_setting is not None:
                notices.append(f"actor_rollout_ref.rollout.{key}={verl_setting}: not used (meshrl's rollouts load the "
                               "model folder, then take the trainer's weights, or adapters, over the weight "
                               "channel, one tensor gathered at a time)")
        multi_turn = rollout.multi_turn
        if multi_turn.enable and multi_turn.tool_config_path is not None:
            notices.append(f"actor_rollout_ref.rollout.multi_turn.tool_config_path={multi_turn.tool_config_path}: "
                           "the env services host the tools (their own config names them: environments."
                           f"{multi_turn.environment}.tool_config_path); coordctl start-run --local starts one with "
                           "this file")
        if multi_turn.enable and multi_turn.agent is not None:
            notices.append(f"actor_rollout_ref.rollout.multi_turn.agent={multi_turn.agent}: the env services run the "
                           f"agents (their own config names them: environments.{multi_turn.environment}.agent); "
                           "coordctl start-run --local starts one with this agent")
        if trainer.use_legacy_worker_impl is not None:
            notices.append(f"trainer.use_legacy_worker_impl={trainer.use_legacy_worker_impl}: meshrl has one "
                           "worker implementation")
        for key, value, setting in (("gpu_memory_utilization", rollout.gpu_memory_utilization,
                                     "gpu_memory_utilization"),
                                    ("tensor_model_parallel_size", rollout.tensor_model_parallel_size,
                                     "tensor_parallel_size")):
            if value is not None:
                notices.append(f"actor_rollout_ref.rollout.{key}={value}: a setting of each rollout service "
                               f"(python -m services.rollout {setting}={value}); coordctl start-run --local passes it "
                               "to the rollout it starts")
        if trainer.test_freq > 0 and not data.val_files:
            notices.append(f"trainer.test_freq={trainer.test_freq}: no validation, data.val_files is empty")
        if data.val_batch_size is not None:
            notices.append(f"data.val_batch_size={data.val_batch_size}: validation sends every held-out prompt at "
                           "once (verl deprecated this key too)")
        return notices

    def require_paths(self) -> None:
        """Refuse a config that names no model or no data it needs (before anything starts)."""
        hint = (" (coordctl start-run --local builds a tiny model and data; "
                "coordctl init FOLDER writes them with a run config)")
        if not self.actor_rollout_ref.model.path:
            raise ValueError(f"actor_rollout_ref.model.path: no model folder given{hint}")
        if not self.data.train_files and not self.trainer.val_only:
            raise ValueError(f"data.train_files: no training data given{hint}")
        if self.trainer.val_only and not self.data.val_files:
            raise ValueError("trainer.val_only validates on data.val_files, which is empty")
