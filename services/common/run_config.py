"""The run config: what a run trains, on what data, with which algorithm.

Key names follow verl where the concept is the same, so a verl user's
``data.train_batch_size=64`` or ``actor_rollout_ref.rollout.n=8`` means the
same thing here. Batch sizes are counted in prompts, as verl counts them.
"""

from __future__ import annotations

from typing import Literal

import pydantic
from pydantic import Field, PositiveFloat, PositiveInt

from services.common.config import Section


class DataConfig(Section):
    train_files: list[str] = []
    """Local parquet or JSONL files in verl's schema (data_source, prompt, reward_model.ground_truth, ...)."""
    train_batch_size: PositiveInt = 32
    """Prompts per step."""
    max_prompt_length: PositiveInt = 512
    """Prompts with more tokens are refused when the data is loaded, naming the row."""
    max_response_length: PositiveInt = 256
    """Most tokens sampled per response."""
    prompt_key: str = "prompt"
    """Row field holding the prompt: a list of chat messages or a string."""
    reward_fn_key: str = "data_source"
    """Row field that picks the reward scorer."""
    shuffle: bool = True
    """Shuffle the rows each epoch (seeded by trainer.seed)."""


class ModelConfig(Section):
    path: str = ""
    """Local Hugging Face model folder (config.json, weights, tokenizer). Filled in by --local."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype of the weights on the trainer and the rollout engine."""


class OptimConfig(Section):
    lr: PositiveFloat = 1e-6
    """Peak learning rate of AdamW."""
    weight_decay: float = Field(0.01, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    lr_warmup_steps: int = Field(0, ge=0)
    """Optimizer steps of linear warmup, then constant."""


class WarmStartConfig(Section):
    steps: int = Field(0, ge=0)
    """Supervised steps on the data's ground truth before RL (0 = none): a stand-in for an SFT model."""
    batch_size: PositiveInt = 64
    """Prompts per supervised step."""
    lr: PositiveFloat = 3e-3
    """Learning rate of the warm start's own AdamW (betas as the actor's, no weight decay)."""


class ActorConfig(Section):
    optim: OptimConfig = OptimConfig()
    ppo_mini_batch_size: PositiveInt = 16
    """Prompts per optimizer step (each with its rollout.n responses)."""
    ppo_micro_batch_size_per_gpu: PositiveInt = 64
    """Sequences per forward/backward; gradients are accumulated over a mini-batch."""
    ppo_epochs: PositiveInt = 1
    clip_ratio_low: float = Field(0.2, gt=0, lt=1)
    """PPO clip range below 1."""
    clip_ratio_high: float = Field(0.2, gt=0)
    """PPO clip range above 1 (raise it for DAPO's clip-higher)."""
    grad_clip: PositiveFloat = 1.0
    """Max global gradient norm."""
    warm_start: WarmStartConfig = WarmStartConfig()


class RolloutConfig(Section):
    name: Literal["hf", "vllm"] = "hf"
    """Engine the rollout services must run; checked against what registered."""
    n: PositiveInt = 8
    """Responses sampled per prompt."""
    temperature: PositiveFloat = 1.0
    top_p: float = Field(1.0, gt=0, le=1)
    stop_token_ids: list[int] = []
    """Token ids that end a response besides EOS."""


class ActorRolloutRefConfig(Section):
    model: ModelConfig = ModelConfig()
    actor: ActorConfig = ActorConfig()
    rollout: RolloutConfig = RolloutConfig()


class AlgorithmConfig(Section):
    adv_estimator: Literal["grpo"] = "grpo"
    """Advantage estimator."""
    norm_adv_by_std_in_grpo: bool = True
    """Divide by the group's std (GRPO) or only subtract its mean (Dr. GRPO)."""


class TrainerConfig(Section):
    total_training_steps: PositiveInt = 100
    project_name: str = "meshrl"
    experiment_name: str = "run"
    seed: int = 0
    """Seeds data order, sampling and initialisation of optimizer state."""
    weight_sync_bucket_mb: PositiveInt = 1024
    """Bucket size of the trainer -> rollout weight broadcast."""
    rpc_timeout_s: PositiveFloat = 600.0
    """Deadline of each training or generation call."""
    services_wait_s: PositiveFloat = 60.0
    """How long a starting run waits for the trainer, rollout and reward services to be up."""


class TinyModelConfig(Section):
    hidden_size: PositiveInt = 128
    num_layers: PositiveInt = 2
    num_heads: PositiveInt = 4
    seed: int = 0


class SyntheticTaskConfig(Section):
    rows: PositiveInt = 20000
    min_digits: PositiveInt = 2
    max_digits: PositiveInt = 5
    seed: int = 1


class LocalConfig(Section):
    """What ``coordctl start-run --local`` builds before it starts the run (ignored otherwise)."""

    tiny_model: TinyModelConfig = TinyModelConfig()
    synthetic_task: SyntheticTaskConfig = SyntheticTaskConfig()


class RunConfig(Section):
    data: DataConfig = DataConfig()
    actor_rollout_ref: ActorRolloutRefConfig = ActorRolloutRefConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    trainer: TrainerConfig = TrainerConfig()
    local: LocalConfig = LocalConfig()

    @pydantic.model_validator(mode="after")
    def _batch_sizes_agree(self) -> RunConfig:
        batch = self.data.train_batch_size
        mini = self.actor_rollout_ref.actor.ppo_mini_batch_size
        if batch % mini:
            raise ValueError(
                f"data.train_batch_size ({batch}) must be a multiple of "
                f"actor_rollout_ref.actor.ppo_mini_batch_size ({mini})"
            )
        if self.algorithm.adv_estimator == "grpo" and self.actor_rollout_ref.rollout.n < 2:
            raise ValueError("algorithm.adv_estimator=grpo needs actor_rollout_ref.rollout.n >= 2 (groups of responses)")
        return self

    def require_paths(self) -> None:
        """Refuse a config that names no model or no data (before anything starts)."""
        if not self.actor_rollout_ref.model.path:
            raise ValueError("actor_rollout_ref.model.path: no model folder given")
        if not self.data.train_files:
            raise ValueError("data.train_files: no training data given")
