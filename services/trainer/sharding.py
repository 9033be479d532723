"""Where a model lives: whole on this rank's device, or sharded over the ranks with FSDP2.

FSDP2 (``fully_shard``) is applied to each decoder layer, then to the root
(embeddings, final norm, head), so each layer's weights are gathered for its
forward and backward only. Parameters become DTensors sharded on dim 0 with
their names unchanged. Optional: mixed precision (the weights stay in their
dtype, fp32 master weights, and are cast to ``param_dtype`` when gathered;
gradients are reduced in ``reduce_dtype``), and parameter offload (the shards,
their gradients and so the optimizer step live in CPU memory).

Nothing here knows about losses: the math sees an ``nn.Module``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from services.run.models import moved
from services.trainer.ranks import Ranks

if TYPE_CHECKING:
    from services.run.models import HFModel


@dataclass(frozen=True, kw_only=True)
class Sharding:
    fsdp: bool  # shard with FSDP2 (otherwise the whole model on this rank's device)
    param_dtype: torch.dtype | None = None  # mixed precision: compute dtype (None: the weights' own)
    reduce_dtype: torch.dtype | None = None  # mixed precision: dtype of gradient reductions
    param_offload: bool = False  # FSDP2's CPUOffloadPolicy


def enable_gradient_checkpointing(model: HFModel) -> None:
    """Recompute each decoder layer's activations in the backward instead of keeping them (non-reentrant
    torch.utils.checkpoint, which works under FSDP2). transformers 5.24 names it activation checkpointing;
    earlier versions only know the gradient checkpointing name."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def decoder_layers(model: HFModel) -> list[torch.nn.Module]:
    """The model's decoder layers: the modules transformers says must not be split across devices."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [module for module in model.modules() if type(module).__name__ in names]
    if not layers:
        raise ValueError(f"{type(model).__name__} names no decoder layer class (_no_split_modules) to shard by")
    return layers


def place(model: HFModel, ranks: Ranks, sharding: Sharding, *, gradient_checkpointing: bool) -> HFModel:
    """Put ``model`` (loaded whole on the CPU) where it trains: on this rank's device, or sharded over the ranks
    (each rank then keeps its own shard of its own copy: every rank must have loaded the same weights)."""
    if gradient_checkpointing:
        enable_gradient_checkpointing(model)
    if not sharding.fsdp:
        return moved(model, ranks.device)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if not dist.is_initialized():  # one rank started without torchrun: a process group of one
        backend = "cpu:gloo,cuda:nccl" if ranks.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    mesh = init_device_mesh(ranks.device.type, (ranks.world_size,))
    mp_policy = MixedPrecisionPolicy(param_dtype=sharding.param_dtype, reduce_dtype=sharding.reduce_dtype)
    offload_policy = (CPUOffloadPolicy(pin_memory=ranks.device.type == "cuda") if sharding.param_offload
                      else OffloadPolicy())
    for module in (*decoder_layers(model), model):  # each layer, then the root
        fully_shard(module, mesh=mesh, mp_policy=mp_policy, offload_policy=offload_policy)
    return model
