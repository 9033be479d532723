"""How the trainer holds a model (verl's fsdp_config): the part of the actor's, the reference's and the critic's
sections that says where the weights live and in which dtype they compute."""

from __future__ import annotations

from typing import Literal

from services.common.config import Section


class MixedPrecisionConfig(Section):
    param_dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    """Dtype of the forward and backward compute: each layer's fp32 weights are cast to it when gathered."""
    reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype in which gradients are reduced over the ranks."""


class FSDPConfig(Section):
    """How the trainer holds a model (verl's fsdp_config)."""

    param_offload: bool = False
    """Keep the weight shards, their gradients and the optimizer state in CPU memory (FSDP2's
    CPUOffloadPolicy): each layer is copied to the GPU for its forward and backward, the optimizer steps on
    the CPU. Needs FSDP (strategy fsdp2 or auto)."""
    optimizer_offload: bool = False
    """Keep the AdamW state in CPU memory between update calls; it comes to the GPU for each update."""
    mixed_precision: MixedPrecisionConfig | None = None
    """Null: weights and compute in actor_rollout_ref.model.dtype. Set ({} for the defaults): fp32 master
    weights and optimizer state, compute in param_dtype, gradient reductions in reduce_dtype (FSDP2's
    MixedPrecisionPolicy; needs strategy fsdp2 or auto)."""

    @property
    def needs_fsdp(self) -> bool:
        return self.param_offload or self.mixed_precision is not None
