"""A mixture of experts' weights under their two names: fused in the model, one tensor per expert on disk.

transformers 5 holds a layer's experts as two parameters (Qwen3-MoE, Qwen2-MoE, Mixtral, ...):
``<layer>.mlp.experts.gate_up_proj`` [E, 2I, H] (each expert's gate rows, then its up rows) and
``<layer>.mlp.experts.down_proj`` [E, H, I]. ``save_pretrained`` writes them, and vLLM's ``load_weights``
reads them, one per expert and projection: ``<layer>.mlp.experts.<e>.gate_proj.weight`` [I, H],
``...up_proj.weight`` [I, H], ``...down_proj.weight`` [H, I].
"""

from __future__ import annotations

import torch

FUSED_EXPERTS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
"""Each fused experts parameter and the projections it holds, stacked along its dim 1 in this order."""


def fused_experts_parts(name: str) -> tuple[str, tuple[str, ...]] | None:
    """(the experts module's name, the projections) when ``name`` is a fused experts parameter, else None."""
    module, _, last = name.rpartition(".")
    if module.endswith(".experts") and last in FUSED_EXPERTS:
        return module, FUSED_EXPERTS[last]
    return None


def per_expert_tensors(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """A fused experts tensor [E, k * I, H] as the checkpoint names its E * k pieces (views, [I, H] each), expert
    by expert; any other tensor as it is."""
    fused = fused_experts_parts(name)
    if fused is None or tensor.dim() != 3:
        return [(name, tensor)]
    module, projections = fused
    pieces = []
    for expert, stacked in enumerate(tensor):
        for projection, piece in zip(projections, stacked.chunk(len(projections), dim=0)):
            pieces.append((f"{module}.{expert}.{projection}.weight", piece))
    return pieces


def checkpoint_shapes(name: str, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    """The tensors (name -> shape) a checkpoint stores for parameter ``name`` of ``shape``, one per expert for a
    fused experts parameter."""
    return {piece: tuple(tensor.shape)
            for piece, tensor in per_expert_tensors(name, torch.empty(shape, device="meta"))}
