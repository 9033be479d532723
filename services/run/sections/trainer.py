"""The trainer section (verl's ``trainer``): how long the run trains, how it is named, logged, checkpointed,
resumed and validated, the deadlines of its calls, the weight sync's transport, and the asynchronous
pipeline."""

from __future__ import annotations

from typing import Literal, get_args

import pydantic
from pydantic import Field, PositiveInt

from services.common.config import Section
from services.common.limits import MAX_WAIT_S
from services.common.paths import check_name
from services.run.sections.data import as_list


WrittenLogger = Literal["console", "tensorboard", "wandb", "mlflow"]
VerlOnlyLogger = Literal["swanlab", "vemlp_wandb", "clearml", "trackio", "file"]  # verl's: accepted, not written
VERL_ONLY_LOGGERS = get_args(VerlOnlyLogger)
LoggerName = Literal[WrittenLogger, VerlOnlyLogger]


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
    max_actor_ckpt_to_keep: PositiveInt | None = None
    """How many checkpoints of the actor the run keeps (verl's key; null = all, verl's default). meshrl saves the
    actor and the critic of a step into one folder, step_<N>/, so a run keeps whole steps: the larger of this and
    max_critic_ckpt_to_keep when the run has a critic (a null one of the two keeps all), else this. Once a save
    is recorded the oldest saved go (folder and run DB record; an event says which), never the one just saved,
    which is the one a resume goes on from. The coordinator removes them: it must see default_local_dir."""
    max_critic_ckpt_to_keep: PositiveInt | None = None
    """How many checkpoints of the critic the run keeps (verl's key; null = all): with a critic, a step's
    folder goes only once both this and max_actor_ckpt_to_keep let it go (see that key); without a critic
    (GRPO and the like) it is not used."""
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
    services/coordinator/runs/loggers.py). The console shows progress whatever is listed, and every metric always
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
