"""The run config: what a run trains, on what data, with which algorithm.

Key names follow verl where the concept is the same, so a verl user's
``data.train_batch_size=64`` or ``actor_rollout_ref.rollout.n=8`` means the
same thing here. Batch sizes are counted in prompts, as verl counts them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import pydantic
from pydantic import Field, PositiveInt

from services.common.config import Section
from services.common.limits import MAX_WAIT_S
from services.common.paths import check_name
from services.run.sections.actor_rollout_ref import ActorRolloutRefConfig
from services.run.sections.algorithm import GROUP_ESTIMATORS, AlgorithmConfig
from services.run.sections.critic import CriticConfig
from services.run.sections.data import DataConfig, as_list
from services.run.sections.placement import PlacementConfig


WRITTEN_LOGGERS = ("console", "tensorboard", "wandb", "mlflow")
VERL_ONLY_LOGGERS = ("swanlab", "vemlp_wandb", "clearml", "trackio", "file")  # verl's: accepted, not written
LoggerName = Literal[WRITTEN_LOGGERS + VERL_ONLY_LOGGERS]


class AsyncConfig(Section):
    max_staleness: int = Field(0, ge=0)
    """Most weight versions a rollout may lag behind the actor it trains (0 = synchronous)."""


DEFAULT_TRAINING_STEPS = 100


class TrainerConfig(Section):
    total_training_steps: PositiveInt | None = None
    """Steps the run trains (each: generate, score, update, sync weights); a resumed run goes on to it. Also
    where the cosine learning-rate schedule ends. Null: total_epochs passes over the training data (each of
    len(data) // data.train_batch_size steps), or 100 steps without total_epochs (verl's key; set, it wins
    over total_epochs, as in verl). The coordinator writes the number it comes to into the run's config."""
    total_epochs: PositiveInt | None = None
    """Passes over the training data when total_training_steps is null (verl's key; its default is 30, here
    none: 100 steps)."""
    critic_warmup: int = Field(0, ge=0)
    """Steps that update only the critic before the actor starts updating."""
    max_recoveries: int = Field(3, ge=0)
    """Times a run waits out a service that went away (then continues from its last checkpoint) before failing;
    a weight channel that failed to form (a rollout died while joining) counts too. A refusal that would come
    again (a WakeUp out of GPU memory, a weight channel refused in each of its 3 formations) fails the run at once."""
    save_freq: int = Field(0, ge=-1)
    """Checkpoint every this many steps (0 or -1, verl's "never": only when the run is stopped); coordctl resume
    continues from the last."""
    default_local_dir: str | None = None
    """Where the checkpoints go, step_<N>/<roles>/ under it (verl's key); a relative path is under the run's
    folder; null = the run's folder's checkpoints/. It must lie inside the coordinator's state_dir and each
    trainer's checkpoint_root (a run naming another folder is refused), and every trainer must see it (one
    node, or a shared file system)."""
    resume_mode: Literal["auto", "disable", "resume_path"] = "auto"
    """What starting a run does with checkpoints already in default_local_dir (verl's key): auto = if the
    latest of them belongs to a run that stopped, failed or was interrupted, that run goes on from it
    (coordctl resume does the same by run id); disable = always a new run; resume_path = the run whose
    checkpoint resume_from_path is goes on from that checkpoint. A new run is refused where default_local_dir
    holds another run's checkpoints, which its saves would replace."""
    resume_from_path: str | None = None
    """With resume_mode resume_path: a checkpoint folder (<...>/step_<N>) of an earlier run, inside the
    coordinator's state_dir (a relative path is under it)."""
    rollout_data_dir: str | None = None
    """Where each step's samples go, <step>.jsonl (verl's key and file): prompt, response, score and its
    components, the weight version that sampled it and its staleness, the rollout and the reward service that
    handled it, its advantage (`coordctl samples RUN --step N` prints them). A relative path is under the run's
    folder; it must lie inside the coordinator's state_dir; null = not written."""
    logger: list[LoggerName] = ["console", "tensorboard"]
    """verl's experiment loggers, each given every metric of every step: tensorboard (event files in the run's
    folder), wandb, mlflow (extras of the same names, installed where the coordinator runs; see
    services/coordinator/loggers.py). The console shows progress whatever is listed, and every metric always
    goes to metrics.jsonl and the run DB. verl's other loggers are accepted and reported as not written."""
    n_gpus_per_node: PositiveInt | None = None
    """verl's Ray placement: meshrl's services are placed per node (systemd, Slurm, --local), so this is
    reported as not used."""
    nnodes: PositiveInt | None = None
    """verl's Ray placement; reported as not used."""
    use_legacy_worker_impl: str | bool | None = None
    """verl's choice between its worker implementations; meshrl has one (reported as not used)."""
    project_name: str = "meshrl"
    """verl's trainer.project_name: the W&B project and the MLflow experiment the run is logged to."""
    experiment_name: str = "run"
    """Names the run: its id is <experiment_name>-<YYYYmmdd-HHMMSS>-<4 hex digits>, its folder
    runs/<run_id>/ under the coordinator's state_dir, and it is the run's name in the run DB, W&B and MLflow
    (verl's trainer.experiment_name). A name, not a path: no '/', not '..'."""
    seed: int = 0
    """Seeds data order, sampling and initialisation of optimizer state."""
    weight_sync_bucket_mb: PositiveInt = 1024
    """Bucket size of the trainer -> rollout weight broadcast. The trainer keeps two buffers of this size for it
    between syncs (on its GPU), and each vLLM worker three (one loading while two arrive)."""
    weight_sync_backend: Literal["auto", "gloo", "nccl", "cuda_ipc"] = "auto"
    """Transport of the weight channel: gloo (CPU), nccl (trainer and rollouts each on GPUs of their own),
    cuda_ipc (one host; rollouts may share the trainer's GPU). auto = gloo for a trainer on CPU, cuda_ipc when
    the rollouts run on the trainer's GPU (NCCL refuses two ranks on one GPU), nccl otherwise."""
    rpc_timeout_s: float = Field(600.0, gt=0, le=MAX_WAIT_S)
    """Deadline of each training or generation call (at most a day: gRPC takes an infinite one as none left)."""
    channel_timeout_s: float = Field(120.0, gt=0, le=MAX_WAIT_S)
    """Deadline of joining the weight channel and of each weight broadcast (at most a day)."""
    services_wait_s: float = Field(60.0, gt=0, le=MAX_WAIT_S)
    """How long a starting run waits for the trainer, rollout and reward services to be up."""
    test_freq: int = Field(-1, ge=-1)
    """Validate on data.val_files every this many steps, and after the last step (-1 or 0: never during
    training; verl's key). With trainer.async_.max_staleness >= 1 the validation of a step's weights runs on
    the rollouts while the trainer already works on the next step; val/weight_version says which weights
    each validation measured."""
    val_before_train: bool = True
    """Validate the starting weights (after the warm start) before the first step, when data.val_files is set
    (verl's key; a resumed run does not validate again before going on)."""
    val_only: bool = False
    """Only validate the model at actor_rollout_ref.model.path on data.val_files, then finish: no trainer is
    needed, no step is trained (verl's key; what coordctl eval runs)."""
    async_: AsyncConfig = AsyncConfig()
    """The asynchronous pipeline (``async`` is a Python keyword, hence the underscore)."""

    _one_or_more_loggers = pydantic.field_validator("logger", mode="before")(as_list)
    _a_name = pydantic.field_validator("experiment_name")(check_name)

    @property
    def steps(self) -> int:
        """The steps the run trains, once total_epochs has been turned into total_training_steps."""
        if self.total_training_steps is not None:
            return self.total_training_steps
        if self.total_epochs is not None:
            raise ValueError("trainer.total_epochs is only known as steps once the data is read (steps_for)")
        return DEFAULT_TRAINING_STEPS


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
        if trainer.use_legacy_worker_impl is not None:
            notices.append(f"trainer.use_legacy_worker_impl={trainer.use_legacy_worker_impl}: meshrl has one "
                           "worker implementation")
        for key, value, setting in (("gpu_memory_utilization", rollout.gpu_memory_utilization, "gpu_memory_utilization"),
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
        hint = " (coordctl start-run --local builds a tiny model and data; coordctl init FOLDER writes them with a run config)"
        if not self.actor_rollout_ref.model.path:
            raise ValueError(f"actor_rollout_ref.model.path: no model folder given{hint}")
        if not self.data.train_files and not self.trainer.val_only:
            raise ValueError(f"data.train_files: no training data given{hint}")
        if self.trainer.val_only and not self.data.val_files:
            raise ValueError("trainer.val_only validates on data.val_files, which is empty")
