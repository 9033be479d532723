"""LoRA adapters on the weight channel: how a LoRA trainer names what it sends, and what a rollout makes of it.

A LoRA actor sends, instead of its weights, two factors per adapted linear layer, under the layer's Hugging Face
module name M (the name in the base model, as the rollout loaded it): ``M.lora_A`` (rank x in) and ``M.lora_B``
(out x rank), B already multiplied by the adapter's scale (lora_alpha / rank), so the layer serves
W = W_base + B @ A. The bucket protocol, its checksums and its manifest are those of full weights
(``weight_sync``); only the names tell a rollout that the broadcast is an adapter.

A LoRA actor whose adapters are served merged (``lora.merge``) sends instead each adapted layer's merged weight
``M.weight`` = W_base + B @ A (``MergedWeight``, made as it is sent), which a rollout loads as full weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.common.weight_sync import full

FACTOR_A, FACTOR_B = ".lora_A", ".lora_B"


def is_adapter(names: list[str]) -> bool:
    """Whether a broadcast of tensors named ``names`` is a LoRA adapter (every name one of its factors)."""
    return bool(names) and all(name.endswith((FACTOR_A, FACTOR_B)) for name in names)


def adapter_pairs(named: list[tuple[str, torch.Tensor]]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Module name -> (A, B) of an adapter broadcast; ValueError naming a module whose factors do not pair up."""
    factors: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in named:
        module, factor = (name.removesuffix(FACTOR_A), "A") if name.endswith(FACTOR_A) else (
            name.removesuffix(FACTOR_B), "B")
        factors.setdefault(module, {})[factor] = tensor
    pairs = {}
    for module, both in factors.items():
        missing = sorted({"A", "B"} - set(both))
        if missing:
            raise ValueError(f"adapter of {module} came without its lora_{missing[0]}")
        a, b = both["A"], both["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise ValueError(f"adapter of {module}: lora_A {list(a.shape)} and lora_B {list(b.shape)} are not the "
                             "factors of one low-rank matrix")
        pairs[module] = a, b
    return pairs


def merged_weight(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """W_base + B @ A (B scaled), computed in fp32 and given back in the base's dtype. [out, in]."""
    return (base.float() + b.float() @ a.float()).to(base.dtype)


@dataclass(frozen=True, kw_only=True)
class MergedWeight:
    """A LoRA layer's weight with its adapter merged in, W_base + scale * B @ A in W_base's dtype, made only when
    the weight channel sends it (``full_tensor``): the base and the factors are gathered then (DTensor shards, on
    every rank in the sender's order), so a sync holds one merged layer at a time, not a merged copy of the model."""

    base: torch.Tensor  # [out, in]
    a: torch.Tensor  # [rank, in]
    b: torch.Tensor  # [out, rank], unscaled
    scale: float  # lora_alpha / rank

    @property
    def shape(self) -> torch.Size:
        return self.base.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.base.dtype

    def numel(self) -> int:
        return self.base.numel()

    def full_tensor(self) -> torch.Tensor:
        return merged_weight(full(self.base), full(self.a), full(self.b).float() * self.scale)
