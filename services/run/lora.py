"""LoRA on a model, with PEFT: which linear layers a run's LoRA keys adapt, the checks made before a run starts,
and the wrapping the trainer applies.

The keys (``services.run.sections.lora``) mean what verl's do. A target entry matches a module whose full name
is the entry or ends in "." + the entry (PEFT's rule); ``all-linear`` is every linear layer but the output layer.
The checks build the model from its config.json on the meta device (no weights read, a fraction of a second),
so a bad key is refused before anything starts, naming the key:
- a target_modules entry that matches no linear layer;
- a lora_rank larger than the smaller side of a layer it adapts;
- a lora_adapter_path that is not an adapter folder of this model (a module it adapts is missing, or its
  factors do not fit the module's shape).

PEFT is imported inside the functions: the coordinator imports this module to check a run config.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeGuard

from services.run.sections.lora import ActorLoraKeys, LoraKeys

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedModel

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER = "default"  # PEFT's name of a model's one adapter
PEFT_PREFIX = "base_model.model."  # what PEFT puts before the wrapped model's module names


def is_lora(model: object) -> TypeGuard[PeftModel]:
    """Whether ``model`` trains LoRA adapters on a frozen base (a PEFT model, which can switch them off)."""
    return hasattr(model, "disable_adapter")


def matches(name: str, entry: str) -> bool:
    """PEFT's rule for a list entry of target_modules or exclude_modules."""
    return name == entry or name.endswith("." + entry)


def output_layer_name(model: Any) -> str:
    """The name of the module that makes a model's outputs: a causal LM's output layer, a value model's head
    (its last child), which a LoRA critic trains whole."""
    head = model.get_output_embeddings()
    if head is None:
        head = list(model.children())[-1]
    return str(next(name for name, module in model.named_modules() if module is head))


def linear_shapes(model: Any) -> dict[str, tuple[int, int]]:
    """Every linear layer of ``model`` but its output layer: name -> (out_features, in_features)."""
    import torch

    head = output_layer_name(model)
    return {name: (module.out_features, module.in_features) for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and name != head}


def adapted_layers(linears: dict[str, tuple[int, int]], keys: LoraKeys) -> dict[str, tuple[int, int]]:
    """The layers of ``linears`` the keys put an adapter on."""
    targets = keys.target_modules
    chosen = {name: shape for name, shape in linears.items()
              if targets == "all-linear" or any(matches(name, entry) for entry in targets)}
    excluded = keys.exclude_modules or []
    return {name: shape for name, shape in chosen.items() if not any(matches(name, entry) for entry in excluded)}


def check_lora_keys(linears: dict[str, tuple[int, int]], keys: LoraKeys, section: str) -> None:
    """Refuse target modules that match nothing and a rank larger than a layer; ``section``: the keys' dotted
    path (actor_rollout_ref.model, critic.model), which the messages name."""
    if keys.target_modules != "all-linear":
        unmatched = [entry for entry in keys.target_modules if not any(matches(name, entry) for name in linears)]
        if unmatched:
            examples = sorted({name.rsplit(".", 1)[-1] for name in linears})
            raise ValueError(f"{section}.target_modules: {unmatched} match no linear layer of the model; its "
                             f"linear layers are named {examples} (or use all-linear)")
    adapted = adapted_layers(linears, keys)
    if not adapted:
        raise ValueError(f"{section}.exclude_modules: {keys.exclude_modules} leaves no layer to adapt")
    name, (out_features, in_features) = min(adapted.items(), key=lambda item: min(item[1]))
    if keys.lora_rank > min(out_features, in_features):
        raise ValueError(f"{section}.lora_rank: {keys.lora_rank} is larger than layer {name} ({out_features} x "
                         f"{in_features}) can hold; choose at most {min(out_features, in_features)} or leave that "
                         "layer out (target_modules, exclude_modules)")


def adapter_factor_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """The tensors of a PEFT adapter folder's safetensors by their names in it, from its header alone."""
    from services.run.models import safetensors_header

    return {name: tuple(entry["shape"]) for name, entry in safetensors_header(folder / ADAPTER_WEIGHTS).items()
            if name != "__metadata__"}


def check_adapter_folder(path: str, linears: dict[str, tuple[int, int]], key: str) -> None:
    """Refuse (naming ``key``) a folder that is not a PEFT LoRA adapter of the model whose linear layers are
    ``linears``."""
    folder = Path(path)
    if not (folder / ADAPTER_CONFIG).is_file() or not (folder / ADAPTER_WEIGHTS).is_file():
        raise ValueError(f"{key}: {path} is not a PEFT adapter folder (it needs {ADAPTER_CONFIG} and "
                         f"{ADAPTER_WEIGHTS}; coordctl export --adapter writes one)")
    adapter = json.loads((folder / ADAPTER_CONFIG).read_text())
    if adapter.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{key}: {path} holds a {adapter['peft_type']} adapter; only LoRA adapters are trained")
    for name, shape in adapter_factor_shapes(folder).items():
        module, _, factor = name.removeprefix(PEFT_PREFIX).rpartition(".lora_")
        if not module:
            continue  # a module saved whole (modules_to_save): PEFT checks it on load
        if module not in linears:
            raise ValueError(f"{key}: {path} adapts {module}, which the model has no linear layer of: the adapter "
                             "was made for another base model")
        out_features, in_features = linears[module]
        fits = shape[1] == in_features if factor.startswith("A") else shape[0] == out_features
        if not fits:
            raise ValueError(f"{key}: {path} adapts {module} with a factor of shape {list(shape)}, which does not "
                             f"fit its {out_features} x {in_features} weight: the adapter was made for another base "
                             "model")


def served_lora_rank(keys: ActorLoraKeys) -> int:
    """The largest rank of the adapters a rollout serves as adapters (0 for full fine-tuning, and for adapters
    merged into the rollout's weights, ``lora.merge``): lora_rank, or with lora_adapter_path that adapter's own
    (its r, or the largest of its per-module rank_pattern)."""
    if not keys.lora_rank or keys.lora.merge:
        return 0
    if not keys.lora_adapter_path:
        return keys.lora_rank
    adapter = json.loads((Path(keys.lora_adapter_path) / ADAPTER_CONFIG).read_text())
    return max([int(adapter["r"]), *(int(rank) for rank in (adapter.get("rank_pattern") or {}).values())])


def meta_model(model_path: str, value_model: bool = False) -> Any:
    """The model of a folder's config.json on the meta device (its module tree, no weights)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

    config = AutoConfig.from_pretrained(model_path, num_labels=1) if value_model else AutoConfig.from_pretrained(
        model_path)
    kind = AutoModelForTokenClassification if value_model else AutoModelForCausalLM
    with torch.device("meta"):
        return kind.from_config(config)  # type: ignore[no-untyped-call]


def check_lora(keys: LoraKeys, model_path: str, section: str, *, value_model: bool = False) -> None:
    """A run's LoRA keys for the model in ``model_path``, checked without loading its weights; nothing to check
    with lora_rank 0."""
    if not keys.lora_rank:
        return
    linears = linear_shapes(meta_model(model_path, value_model))
    adapter_path = getattr(keys, "lora_adapter_path", None)
    if adapter_path:
        check_adapter_folder(adapter_path, linears, f"{section}.lora_adapter_path")
    else:
        check_lora_keys(linears, keys, section)


def peft_config(keys: LoraKeys, modules_to_save: list[str] | None = None) -> Any:
    """PEFT's LoraConfig of the keys (no dropout: the PPO ratio compares two passes, which must agree)."""
    from peft import LoraConfig

    return LoraConfig(r=keys.lora_rank, lora_alpha=keys.lora_alpha, target_modules=keys.target_modules,
                      exclude_modules=keys.exclude_modules, lora_dropout=0.0, bias="none",
                      modules_to_save=modules_to_save)


def with_lora(model: PreTrainedModel, keys: LoraKeys, modules_to_save: list[str] | None = None) -> PeftModel:
    """``model`` wrapped by PEFT: fresh adapters as the keys say (B zero: the model computes as before), or the
    adapter of ``lora_adapter_path``, trainable; only the adapters (and ``modules_to_save``, whole) train.

    On a bf16 or fp16 base PEFT keeps the adapters in fp32 (the optimizer's small updates would be lost in
    bf16), and would cast each adapted layer's input to fp32 for them: a copy of the input that every adapted
    layer keeps for its backward, more than full fine-tuning keeps. The inputs are left as they are here; such a
    model computes inside ``adapter_autocast``, which casts the adapters instead."""
    from peft import PeftModel, get_peft_model
    from peft.tuners.tuners_utils import BaseTunerLayer

    adapter_path = keys.lora_adapter_path if isinstance(keys, ActorLoraKeys) else None
    if adapter_path:
        wrapped = PeftModel.from_pretrained(model, adapter_path, is_trainable=True)
    else:
        wrapped = get_peft_model(model, peft_config(keys, modules_to_save))
    adapted: list[Any] = [module for module in wrapped.modules() if isinstance(module, BaseTunerLayer)]
    for layer in adapted:
        layer.cast_input_dtype_enabled = False
    return wrapped


def adapter_autocast(model: Any, device_type: str) -> Any:
    """The context a model's forward passes run in: for a LoRA model on a bf16 or fp16 base, torch.autocast to
    that dtype, which casts the fp32 adapters (small) to it where they are used and leaves the activations as
    they are (``with_lora``); nothing for any other model. A base held in fp32 (fp32, or FSDP2's mixed
    precision, which casts every parameter alike) needs none."""
    import torch

    base_dtype = model.get_input_embeddings().weight.dtype
    if is_lora(model) and base_dtype in (torch.bfloat16, torch.float16):
        return torch.autocast(device_type, dtype=base_dtype)
    return contextlib.nullcontext()
