"""``coordctl export``: a checkpoint of a run as a Hugging Face model folder.

A checkpoint is a torch.distributed.checkpoint folder per trainer service
(``checkpoints/step_N/<roles>/``), each rank of the trainer having written its
own shards. Here, in one process, one role's whole weights are read back
(DCP gathers the shards of any number of ranks) into a model built from the
run's model folder's config, and written with ``save_pretrained``: config,
safetensors shards, generation config, beside the tokenizer files of the
run's model folder. The checkpoint's signed manifest is checked first (see
``services.common.manifest``; the key is the state_dir's checkpoint.key).
The actor becomes a causal LM (what transformers, vLLM and a new run load),
the critic a token-classification model with one output (a value model, as
the trainer builds its critic). A LoRA run's checkpoint holds its adapters: the
export loads the run's base model folder, puts the adapters on it as the
trainer did, and writes them merged into the base (default) or, with
``--adapter``, as PEFT's adapter folder, which PEFT and vLLM load onto the base.
Beside the model, ``meshrl_export.json`` records where it came from and the
run's prompt and response lengths, which ``coordctl eval`` of the folder defaults to.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import yaml

from services.common.config import validate
from services.common.manifest import MANIFEST, checkpoint_key, verify
from services.run.config import RunConfig
from services.run.sections.lora import LoraKeys

EXPORT_RECORD = "meshrl_export.json"
EVAL_DATA_KEYS = ("max_prompt_length", "max_response_length", "truncation", "return_raw_chat")
"""The run's data.* keys an export records in EXPORT_RECORD: how long a prompt and a response may be, and what
a longer prompt becomes; ``coordctl eval`` of the folder starts from them (and from a multi-turn run's
actor_rollout_ref.rollout.multi_turn, recorded too: a model trained to call tools is scored calling them)."""


def checkpoint_steps(folder: Path, role: str) -> dict[int, Path]:
    """Step -> the complete checkpoint folder in ``folder`` holding ``role`` (a trainer's folder is named by its
    roles)."""
    found = {}
    for step_dir in sorted(folder.glob("step_*")):
        for folder in step_dir.iterdir():
            if role in folder.name.split("-") and (folder / MANIFEST).exists():  # written last: complete
                found[int(step_dir.name.removeprefix("step_"))] = folder
    return found


def checkpoint_of(folder: Path, step: int | None, role: str) -> tuple[int, Path]:
    """The checkpoint of ``step`` (None: the last) in ``folder``, or ValueError saying which steps there are."""
    steps = checkpoint_steps(folder, role)
    if not steps:
        raise ValueError(f"{folder} holds no complete checkpoint of the {role} (trainer.save_freq sets how often a "
                         "run saves one; a stopped run saves its last step)")
    if step is None:
        step = max(steps)
    if step not in steps:
        raise ValueError(f"{folder} has no checkpoint of step {step}; it has steps {sorted(steps)}")
    return step, steps[step]


def role_model(config: RunConfig, role: str):
    """The role's model as the trainer builds it, from its folder's config alone (the weights come after)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

    if role == "actor":
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config.actor_rollout_ref.model.path))
    model_config = AutoConfig.from_pretrained(config.critic.model.path or config.actor_rollout_ref.model.path,
                                              num_labels=1)
    model_config.classifier_dropout = 0.0
    return AutoModelForTokenClassification.from_config(model_config)


def load_role_weights(model, folder: Path, role: str) -> None:
    """Read ``role``'s weights from a DCP checkpoint folder into ``model``; every parameter must be there (a
    weight tied to another counts as there)."""
    missing, unexpected = model.load_state_dict(read_role_state(folder, role), strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    untied = [name for name in missing if name not in tied]
    if untied or unexpected:
        raise ValueError(f"checkpoint {folder} does not fit the run's model: missing {untied[:5]}, "
                         f"unexpected {list(unexpected)[:5]}")
    if tied:
        model.tie_weights()


def lora_keys_of(config: RunConfig, role: str) -> LoraKeys:
    return config.actor_rollout_ref.model if role == "actor" else config.critic.model


def lora_role_model(config: RunConfig, role: str, folder: Path):
    """A LoRA role as the trainer built it (its base from the run's model folder, PEFT's wrapping), its
    adapters (and a critic's value head) read from the checkpoint ``folder``."""
    from services.run.lora import output_layer_name, with_lora
    from services.run.models import load_causal_lm, load_value_model

    path = config.actor_rollout_ref.model.path if role == "actor" else (
        config.critic.model.path or config.actor_rollout_ref.model.path)
    load = load_causal_lm if role == "actor" else load_value_model
    base = load(path, "float32", config.actor_rollout_ref.model.allow_pickle)
    model = with_lora(base, lora_keys_of(config, role),
                      modules_to_save=None if role == "actor" else [output_layer_name(base)])
    trained = {name for name, parameter in model.named_parameters() if parameter.requires_grad}
    stored = read_role_state(folder, role)
    # a run whose warm start trained the full weights (warm_start.full_weights) keeps that base beside the adapters
    wanted = set(model.state_dict()) if set(stored) - trained else trained
    missing = sorted(wanted - set(stored))
    if missing or set(stored) - wanted:
        raise ValueError(f"checkpoint {folder} does not hold the adapters of the run's model: missing "
                         f"{missing[:5]}, unexpected {sorted(set(stored) - wanted)[:5]}")
    model.load_state_dict(stored, strict=False)
    return model


def holds_base(folder: Path, role: str) -> bool:
    """Whether a LoRA role's checkpoint holds its base's weights beside its adapters (the warm start trained them:
    warm_start.full_weights)."""
    import torch.distributed.checkpoint as dcp

    stored = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    return any(key.startswith(f"{role}.model.") and ".base_layer." in key for key in stored)


def read_role_state(folder: Path, role: str) -> dict:
    """Every tensor of ``role``'s model state in a DCP checkpoint folder, read whole in this one process."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    prefix = f"{role}.model."
    stored = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    wanted = {key.removeprefix(prefix): torch.empty(meta.size, dtype=meta.properties.dtype)
              for key, meta in stored.items() if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)}
    request = {role: {"model": wanted}}
    with warnings.catch_warnings():  # "torch.distributed is ... uninitialized": one process reads every shard
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(request, checkpoint_id=str(folder), no_dist=True)
    return request[role]["model"]


def export(run_dir: Path, out_dir: Path, step: int | None = None, *, role: str = "actor",
           adapter: bool = False) -> tuple[int, Path]:
    """Write the ``role``'s weights of ``step`` (None: the last checkpoint) as a Hugging Face folder into
    ``out_dir``, in the run's actor_rollout_ref.model.dtype (a LoRA run's adapters merged into its base); or,
    with ``adapter``, a LoRA run's adapter alone as a PEFT adapter folder (adapter_config.json,
    adapter_model.safetensors, naming the run's model folder as its base). Returns the step and the folder."""
    import torch

    from services.run.models import load_tokenizer

    if role not in ("actor", "critic"):
        raise ValueError(f"role must be actor or critic, got {role!r}")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ValueError(f"{out_dir} is not empty: export into a new folder")
    config = validate(RunConfig, yaml.safe_load((run_dir / "config.yaml").read_text()))
    lora = bool(lora_keys_of(config, role).lora_rank)
    if adapter and not lora:
        keys = "actor_rollout_ref.model" if role == "actor" else "critic.model"
        raise ValueError(f"--adapter: run {run_dir.name} trained the {role}'s full weights ({keys}.lora_rank is 0), "
                         "so it has no adapter; export it without --adapter")
    step, folder = checkpoint_of(config.checkpoint_dir(run_dir), step, role)
    verify(folder, checkpoint_key(run_dir.parent.parent))  # the key of the state_dir, which holds runs/<run_id>
    if lora:
        model = lora_role_model(config, role, folder)
        if adapter and holds_base(folder, role):
            raise ValueError(f"--adapter: run {run_dir.name}'s warm start trained the {role}'s full weights "
                             "(actor_rollout_ref.actor.warm_start.full_weights), so its adapters sit on that base, "
                             "not on the model folder; export it merged, without --adapter")
        model = model if adapter else model.merge_and_unload()
    else:
        model = role_model(config, role)
        load_role_weights(model, folder, role)
    model = model.to(getattr(torch, config.actor_rollout_ref.model.dtype))
    tokenizer = load_tokenizer(config.actor_rollout_ref.model.path)
    if getattr(model, "generation_config", None) is not None:  # a causal LM (the value model has none)
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    out_dir.mkdir(parents=True, exist_ok=True)
    if adapter:
        model.save_pretrained(out_dir)  # PEFT's adapter folder
    else:
        model.save_pretrained(out_dir, safe_serialization=True, max_shard_size="4GB")
    tokenizer.save_pretrained(out_dir)
    data = {key: getattr(config.data, key) for key in EVAL_DATA_KEYS}
    multi_turn = config.actor_rollout_ref.rollout.multi_turn
    rollout = {"multi_turn": multi_turn.model_dump(mode="json")} if multi_turn.enable else {}
    (out_dir / EXPORT_RECORD).write_text(json.dumps(
        {"run_dir": str(run_dir), "step": step, "role": role, "checkpoint": str(folder), "data": data,
         "rollout": rollout, "adapter": adapter}, indent=1) + "\n")
    return step, out_dir


def merge_adapter(adapter_dir: Path, out_dir: Path) -> Path:
    """A PEFT LoRA adapter folder merged onto its base (adapter_config.json's base_model_name_or_path, a local
    model folder) as a Hugging Face folder in ``out_dir``, with the adapter folder's tokenizer and export record
    (for ``coordctl eval``, whose rollouts serve a model folder)."""
    import shutil

    from peft import PeftModel

    from services.run.lora import ADAPTER_CONFIG
    from services.run.models import load_causal_lm, load_tokenizer

    base = json.loads((adapter_dir / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path") or ""
    if not (Path(base) / "config.json").exists():
        raise ValueError(f"{adapter_dir}: its base model {base!r} (adapter_config.json's base_model_name_or_path) "
                         "is not a model folder here")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ValueError(f"{out_dir} is not empty: the adapter is merged into a new folder")
    merged = PeftModel.from_pretrained(load_causal_lm(base), str(adapter_dir)).merge_and_unload()
    out_dir.mkdir(parents=True, exist_ok=True)
    merged.save_pretrained(out_dir, safe_serialization=True, max_shard_size="4GB")
    tokenizer_source = adapter_dir if (adapter_dir / "tokenizer_config.json").exists() else Path(base)
    load_tokenizer(tokenizer_source).save_pretrained(out_dir)
    if (adapter_dir / EXPORT_RECORD).exists():
        shutil.copy(adapter_dir / EXPORT_RECORD, out_dir / EXPORT_RECORD)
    return out_dir


def exported_settings(model_dir: Path) -> dict:
    """The run's settings that ``export`` recorded beside the model, for ``coordctl eval`` to default to: its
    data.* (EVAL_DATA_KEYS) and, for a multi-turn run, actor_rollout_ref.rollout.multi_turn, as a run config's
    sections; empty for a folder that was not exported by coordctl or that predates the record."""
    record = model_dir / EXPORT_RECORD
    if not record.exists():
        return {}
    recorded = json.loads(record.read_text())
    rollout = recorded.get("rollout", {})
    return {"data": recorded.get("data", {}), **({"actor_rollout_ref": {"rollout": rollout}} if rollout else {})}
