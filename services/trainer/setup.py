"""From a run config to the trainer's roles: actor, critic, reference (the settings of their ops are in
``settings``).

Each rank builds the same roles from the same seeds, then places them
(``sharding.place``): whole on its device, or sharded with FSDP2.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from services.run.lora import output_layer_name, with_lora
from services.run.models import load_causal_lm, load_tokenizer, load_value_model
from services.run.config import RunConfig
from services.run.sections.actor import ActorConfig
from services.run.sections.fsdp import FSDPConfig
from services.run.sections.optim import OptimConfig
from services.trainer.actor import Actor
from services.trainer.critic import Critic
from services.trainer.optim import OptimSettings
from services.trainer.ranks import Ranks
from services.trainer.settings import packs
from services.trainer.sharding import Sharding, place
from services.trainer.varlen_attention import VARLEN, register

if TYPE_CHECKING:
    from services.run.models import HFModel

ROLES = ("actor", "critic", "ref")


def attention(packed: bool) -> str | None:
    """The attention a trainer's model is loaded with: the varlen one (``varlen_attention``) where its passes pack,
    else transformers' default."""
    if not packed:
        return None
    register()
    return VARLEN


def optim_settings(optim: OptimConfig, grad_clip: float, total_steps: int, *, offload: bool) -> OptimSettings:
    return OptimSettings(lr=optim.lr, weight_decay=optim.weight_decay, betas=optim.betas, grad_clip=grad_clip,
                         warmup_steps=optim.lr_warmup_steps, warmup_style=optim.warmup_style,
                         min_lr_ratio=optim.min_lr_ratio, total_steps=total_steps, offload=offload)


def warm_start_settings(actor: ActorConfig) -> OptimSettings:
    """The warm start's own AdamW: its lr and schedule over its steps, the actor's betas and grad_clip, no weight
    decay."""
    warm = actor.warm_start
    return OptimSettings(lr=warm.lr, weight_decay=0.0, betas=actor.optim.betas, grad_clip=actor.grad_clip,
                         warmup_steps=warm.lr_warmup_steps, warmup_style=warm.warmup_style,
                         min_lr_ratio=warm.min_lr_ratio, total_steps=warm.steps,
                         offload=actor.fsdp_config.optimizer_offload)


def pad_id_of(model_path: str) -> int:
    tokenizer = load_tokenizer(model_path)
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def sharding_of(strategy: str, fsdp: FSDPConfig, world_size: int, *, role: str) -> Sharding:
    """How one model is held on a trainer of ``world_size`` ranks (``strategy`` auto resolved, see its docstring)."""
    if strategy == "none" and world_size > 1:
        raise ValueError(f"{role}.strategy=none: this trainer runs {world_size} ranks, which would each train a "
                         "copy of their own; use fsdp2 or auto")
    if strategy == "none" or (strategy == "auto" and world_size == 1 and not fsdp.needs_fsdp):
        return Sharding(fsdp=False)
    mixed = fsdp.mixed_precision
    return Sharding(fsdp=True, param_dtype=getattr(torch, mixed.param_dtype) if mixed else None,
                    reduce_dtype=getattr(torch, mixed.reduce_dtype) if mixed else None,
                    param_offload=fsdp.param_offload)


def actor_sharding(config: RunConfig, world_size: int) -> Sharding:
    actor = config.actor_rollout_ref.actor
    return sharding_of(actor.strategy, actor.fsdp_config, world_size, role="actor_rollout_ref.actor")


def critic_sharding(config: RunConfig, world_size: int) -> Sharding:
    return sharding_of(config.critic.strategy, config.critic.model.fsdp_config, world_size, role="critic")


def weights_dtype(dtype: str, fsdp: FSDPConfig) -> str:
    """The dtype a trainable model is loaded in: fp32 master weights under mixed precision, else ``dtype``."""
    return "float32" if fsdp.mixed_precision is not None else dtype


def build_actor(config: RunConfig, seed: int, ranks: Ranks) -> Actor:
    """The actor model named by the run config, placed on the ranks, with its optimizer; seeded from ``seed``."""
    model_config, actor = config.actor_rollout_ref.model, config.actor_rollout_ref.actor
    torch.manual_seed(seed)
    base = load_causal_lm(model_config.path, weights_dtype(model_config.dtype, actor.fsdp_config),
                          model_config.allow_pickle,
                          attn_implementation=attention(packs(model_config.use_remove_padding, ranks.device)))
    model = with_lora(base, model_config) if model_config.lora_rank else base
    model = place(model, ranks, actor_sharding(config, ranks.world_size),
                  gradient_checkpointing=model_config.enable_gradient_checkpointing)
    optim = optim_settings(actor.optim, actor.grad_clip, config.trainer.steps,
                           offload=actor.fsdp_config.optimizer_offload)
    return Actor(model, optim, warm_start_settings(actor), pad_id=pad_id_of(model_config.path), seed=seed, ranks=ranks,
                 merge_adapters=model_config.lora.merge, trains_base=config.warm_start_trains_base)


def build_critic(config: RunConfig, seed: int, ranks: Ranks) -> Critic:
    """A value model on the critic's body (the actor's model unless critic.model.path says otherwise)."""
    critic = config.critic
    path = critic.model.path or config.actor_rollout_ref.model.path
    torch.manual_seed(seed + 1)
    base = load_value_model(path, weights_dtype(config.actor_rollout_ref.model.dtype, critic.model.fsdp_config),
                            config.actor_rollout_ref.model.allow_pickle,
                            attn_implementation=attention(packs(critic.model.use_remove_padding, ranks.device)))
    model = with_lora(base, critic.model, modules_to_save=[output_layer_name(base)]) if critic.model.lora_rank else base
    model = place(model, ranks, critic_sharding(config, ranks.world_size),
                  gradient_checkpointing=critic.model.enable_gradient_checkpointing)
    optim = optim_settings(critic.optim, critic.grad_clip, config.trainer.steps,
                           offload=critic.model.fsdp_config.optimizer_offload)
    return Critic(model, optim, pad_id_of(path), seed=seed, ranks=ranks)


def reference_is_actor_base(config: RunConfig, roles: list[str]) -> bool:
    """Whether the reference is the actor's own base model with its adapters switched off (a LoRA actor on this
    trainer), so that no second copy of the model is loaded."""
    return bool(config.actor_rollout_ref.model.lora_rank) and "actor" in roles and "ref" in roles


def build_reference(config: RunConfig, ranks: Ranks) -> HFModel:
    """The frozen reference policy: the actor's initial model, never updated, held as actor_rollout_ref.ref's
    fsdp_config says (the actor's when null); under mixed precision its weights are kept in the compute dtype,
    which is all it is ever used in."""
    actor_rollout_ref = config.actor_rollout_ref
    fsdp = actor_rollout_ref.ref.fsdp_config or actor_rollout_ref.actor.fsdp_config
    dtype = fsdp.mixed_precision.param_dtype if fsdp.mixed_precision is not None else actor_rollout_ref.model.dtype
    sharding = sharding_of(actor_rollout_ref.actor.strategy, fsdp, ranks.world_size, role="actor_rollout_ref.ref")
    model = place(load_causal_lm(actor_rollout_ref.model.path, dtype, actor_rollout_ref.model.allow_pickle,
                                 attn_implementation=attention(packs(actor_rollout_ref.model.use_remove_padding,
                                                                     ranks.device))),
                  ranks, sharding, gradient_checkpointing=False)
    model.eval().requires_grad_(False)
    return model
