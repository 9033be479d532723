"""LoRA keys (verl's, on actor_rollout_ref.model and critic.model): train low-rank adapters on a frozen base
instead of every weight.

With ``lora_rank`` > 0 each targeted linear layer W (out x in) gets two trainable factors, A (rank x in) and B
(out x rank, zero at the start), and computes as W + (lora_alpha / lora_rank) * B @ A; everything else is frozen.
``lora_rank: 0`` is full fine-tuning.
"""

from __future__ import annotations

from typing import Literal

import pydantic
from pydantic import NonNegativeInt, PositiveInt

from services.common.config import Section


class LoraKeys(Section):
    lora_rank: NonNegativeInt = 0
    """Rank of the LoRA adapters; 0 = full fine-tuning (every weight trained). verl's advice: at least 32 for a
    0.5B model, 128 for 32B, to match full fine-tuning; LoRA usually wants about 10x the full fine-tune's lr."""
    lora_alpha: PositiveInt = 16
    """LoRA's alpha: each adapter adds (lora_alpha / lora_rank) * B @ A to its layer's weight."""
    target_modules: Literal["all-linear"] | list[str] = "all-linear"
    """Which linear layers get adapters: all-linear = every linear layer of the decoder (not the output layer),
    or a list of module names, each matched as PEFT matches them (the last part of a module's name, e.g. q_proj,
    v_proj; or a full name). An entry that matches no linear layer of the model is refused before the run
    starts."""
    exclude_modules: list[str] | None = None
    """Module names (matched as target_modules' are) that get no adapter even where target_modules names them;
    null = none excluded."""


class LoraMergeKeys(Section):
    """verl's actor_rollout_ref.model.lora block (its Megatron settings, of which meshrl takes ``merge``)."""

    merge: bool = False
    """Serve the trained adapters merged into the rollout's weights instead of as LoRA adapters: each sync sends,
    per adapted layer, its base weight + B @ A in the rollout's dtype (the layers no adapter touches never change
    and are not sent), and the rollout serves them as full weights, with no LoRA kernels (verl's merge: True).
    Syncs carry more bytes (the adapted layers' weights, not their factors) and, in bf16, a small change to a
    weight may round away in the merged weight, which the adapters keep exactly; generation runs at the base
    model's speed. The trainer, its checkpoints and exports are the same either way. False: syncs send the
    adapters' factors alone, which the rollout serves as LoRA adapters."""


class ActorLoraKeys(LoraKeys):
    lora: LoraMergeKeys = LoraMergeKeys()
    """How the rollout serves the adapters (verl's model.lora block): merged into its weights or as adapters."""
    lora_adapter_path: str | None = None
    """A PEFT adapter folder (adapter_config.json, adapter_model.safetensors) to start from instead of fresh
    adapters: its own rank, alpha and target modules are used (lora_rank must still be > 0). Refused before the
    run starts when it is not an adapter of this model (a module it adapts is missing or of another shape)."""
    use_shm: bool = False
    """verl copies the model folder into /dev/shm before loading it. Accepted; meshrl loads the model folder where
    it is, and never writes an adapter to a file to move it (adapters are synced in memory over the weight
    channel), so there is nothing to put in shared memory: reported as not used."""

    @pydantic.model_validator(mode="after")
    def _adapter_needs_rank(self) -> ActorLoraKeys:
        if self.lora_adapter_path and not self.lora_rank:
            raise ValueError(f"lora_adapter_path: {self.lora_adapter_path} is an adapter to train further, which "
                             "needs lora_rank > 0 (lora_rank 0 is full fine-tuning)")
        if self.lora.merge and not self.lora_rank:
            raise ValueError("lora.merge: true merges LoRA adapters into the rollout's weights, and this run trains "
                             "full weights (lora_rank 0): set lora_rank > 0, or leave lora.merge false")
        return self


LoadFormat = Literal["auto", "dummy", "hf", "safetensors", "dtensor", "dummy_dtensor", "dummy_hf",
                     "dummy_megatron", "megatron"]
