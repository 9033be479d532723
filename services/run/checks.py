"""What a run reads before it starts, checked before anything starts: the model folder, every data file, the
batch sizes against the data, the sequence lengths against the model; and the experiment loggers it writes.

coordctl runs it before it starts local services (and for --dry-run), the coordinator on every StartRun:
each error names the config key, or the file and row. The model folder, the files, their schema and the batch
sizes are checked first, in a fraction of a second; the prompts' lengths need the tokenizer (transformers
takes a few seconds to import).
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.run.data import Prompt, count_rows, load_prompts
from services.run.lora import check_lora
from services.run.models import load_tokenizer, refuse_pickled_weights
from services.run.config import RunConfig

LOGGER_NEEDS = {  # experiment logger -> the modules it imports, and what installs them
    "tensorboard": (("tensorboard",), "tensorboard"),
    "wandb": (("wandb",), "'meshrl[wandb]'"),
    "mlflow": (("mlflow", "sqlalchemy", "alembic"), "'meshrl[mlflow]'"),
}
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json",
                "pytorch_model.bin", "pytorch_model.bin.index.json")


@dataclass(frozen=True, kw_only=True)
class RunData:
    """The model's tokenizer, the training and the held-out prompts of a run."""

    tokenizer: object
    prompts: list[Prompt]
    val_prompts: list[Prompt]
    dropped: int  # over-long prompts dropped (data.filter_overlong_prompts)

    def describe(self) -> str:
        dropped = f" ({self.dropped} over data.max_prompt_length dropped)" if self.dropped else ""
        return f"{len(self.prompts)} training prompts{dropped}, {len(self.val_prompts)} held-out"


def check_model_folder(path: str, key: str) -> dict[str, Any]:
    """The folder's config.json, once the folder is known to hold a config, weights and a tokenizer; ValueError
    naming ``key`` otherwise."""
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"{key}: {path} is not a folder (models are read from local folders; nothing is "
                         "downloaded)")
    try:
        config: dict[str, Any] = json.loads((folder / "config.json").read_text())
    except FileNotFoundError:
        raise ValueError(f"{key}: no config.json in {path}") from None
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{key}: {folder / 'config.json'} cannot be read ({error})") from None
    if not any((folder / name).exists() for name in WEIGHT_FILES) and not any(folder.glob("*.safetensors")):
        raise ValueError(f"{key}: no weights in {path} (looked for {', '.join(WEIGHT_FILES)})")
    if not (folder / "tokenizer.json").exists() and not (folder / "tokenizer_config.json").exists():
        raise ValueError(f"{key}: no tokenizer in {path} (tokenizer.json or tokenizer_config.json)")
    return config


EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
"""The config.json keys under which model families name their experts per layer (Qwen-MoE, Mixtral, DeepSeek)."""


def is_mixture_of_experts(path: str) -> bool:
    """Whether the model folder's config.json names experts (False where it cannot be read: ``check_model_folder``
    refuses such a folder before a run starts)."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return any(isinstance(config.get(key), int) and config[key] > 0 for key in EXPERT_COUNT_KEYS)


def check_loggers_installed(loggers: Sequence[str]) -> None:
    """Every experiment logger of trainer.logger can be written from this Python (the coordinator's, or coordctl's
    for --local); ValueError naming the key, the loggers missing and what installs them otherwise."""
    missing = [name for name in loggers if name in LOGGER_NEEDS
               and not all(importlib.util.find_spec(module) for module in LOGGER_NEEDS[name][0])]
    if missing:
        install = " ".join(LOGGER_NEEDS[name][1] for name in missing)
        raise ValueError(f"trainer.logger: not installed where the coordinator runs: {', '.join(missing)} (pip install "
                         f"{install}, or take it off the list)")


def overlong_rule(config: RunConfig) -> str:
    """What load_prompts does with a prompt over data.max_prompt_length: drop, refuse (error) or cut."""
    return "drop" if config.data.filter_overlong_prompts else config.data.truncation


def load_run_data(config: RunConfig) -> RunData:
    """Check the model folders and read every data file; ValueError naming the key, or the file and row."""
    model = config.actor_rollout_ref.model
    model_config = check_model_folder(model.path, "actor_rollout_ref.model.path")
    refuse_pickled_weights(model.path, model.allow_pickle, "actor_rollout_ref.model.path")
    if config.use_critic and config.critic.model.path:
        check_model_folder(config.critic.model.path, "critic.model.path")
        refuse_pickled_weights(config.critic.model.path, model.allow_pickle, "critic.model.path")
    check_run_lora(config)
    data = config.data
    if not config.trainer.val_only:  # the files and their schema first: they need no tokenizer (which takes seconds)
        check_batch_sizes(config, count_rows(data.train_files, data.prompt_key, data.reward_fn_key))
    count_rows(data.val_files, data.prompt_key, data.reward_fn_key)
    longest = data.max_prompt_length + data.max_response_length
    positions = model_config.get("max_position_embeddings")
    if positions is not None and longest > positions:
        raise ValueError(f"data.max_prompt_length + data.max_response_length = {longest} is more than the model "
                         f"takes (max_position_embeddings {positions} in {model.path}/config.json)")
    try:
        tokenizer = load_tokenizer(model.path)
    except Exception as error:  # noqa: BLE001 - any failure to read it names the folder
        raise ValueError(f"actor_rollout_ref.model.path: the tokenizer in {model.path} cannot be loaded "
                         f"({type(error).__name__}: {error})") from None

    if config.actor_rollout_ref.rollout.multi_turn.enable and not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"actor_rollout_ref.rollout.multi_turn.enable: the tokenizer in {model.path} has no chat "
                         "template, and a multi-turn run renders its turns and the tools' replies with it")

    def load(files: list[str]) -> tuple[list[Prompt], int]:
        return load_prompts(files, data.prompt_key, data.reward_fn_key, tokenizer=tokenizer,
                            max_len=data.max_prompt_length,
                            overlong=overlong_rule(config))

    prompts, dropped = load(data.train_files) if not config.trainer.val_only else ([], 0)
    val_prompts = load(data.val_files)[0] if data.val_files else []
    if not config.trainer.val_only:
        check_batch_sizes(config, len(prompts))
    return RunData(tokenizer=tokenizer, prompts=prompts, val_prompts=val_prompts, dropped=dropped)


def check_run_lora(config: RunConfig) -> None:
    """The actor's and the critic's LoRA keys against their models (``lora.check_lora``)."""
    model_path = config.actor_rollout_ref.model.path
    check_lora(config.actor_rollout_ref.model, model_path, "actor_rollout_ref.model")
    if config.use_critic:
        check_lora(config.critic.model, config.critic.model.path or model_path, "critic.model", value_model=True)


def check_batch_sizes(config: RunConfig, rows: int) -> None:
    """Every batch a run draws fits in its training data."""
    data, warm_start = config.data, config.actor_rollout_ref.actor.warm_start
    files = ", ".join(data.train_files)
    if rows < data.train_batch_size:
        raise ValueError(f"data.train_batch_size ({data.train_batch_size}) is larger than the data ({rows} prompts "
                         f"in {files})")
    if warm_start.steps and rows < warm_start.batch_size:
        raise ValueError(f"actor_rollout_ref.actor.warm_start.batch_size ({warm_start.batch_size}) is larger than the "
                         f"data ({rows} prompts in {files})")
    taught = warm_start.steps * warm_start.batch_size
    if warm_start.own_rows and rows - taught < data.train_batch_size:
        raise ValueError(f"actor_rollout_ref.actor.warm_start.own_rows: the warm start's {taught} rows (steps x "
                         f"batch_size) leave {max(rows - taught, 0)} of the {rows} prompts in {files} for RL, fewer "
                         f"than data.train_batch_size ({data.train_batch_size})")
