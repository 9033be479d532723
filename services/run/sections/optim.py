"""AdamW and its learning-rate schedule (verl's optim): the part of the actor's and the critic's sections that
says how their weights are stepped."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, PositiveFloat

from services.common.config import Section


class OptimConfig(Section):
    lr: PositiveFloat = 1e-6
    """Peak learning rate of AdamW."""
    weight_decay: float = Field(0.01, ge=0)
    """AdamW's decoupled weight decay (torch.optim.AdamW's weight_decay): each optimizer step multiplies every
    trained weight, biases and norms included, by 1 - lr * weight_decay at that step's scheduled lr."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW's (beta1, beta2): decay rates of its running means of the gradient and of the squared gradient.
    The actor's also serve its warm start's optimizer."""
    lr_warmup_steps: int = Field(0, ge=0)
    """Training steps W of linear warmup (0 = none); the schedule advances once per update call, as in verl.
    Training step k (1-based) updates at lr * k / W up to k = W: lr / W first, the full lr at step W. verl by
    default ramps one step later, at lr * (k - 1) / W, so its first update runs at lr 0 and changes nothing;
    meshrl does not spend an RL step that way."""
    warmup_style: Literal["constant", "cosine"] = "constant"
    """After warmup: constant, or cosine decay to min_lr_ratio at trainer.total_training_steps."""
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    """Floor of the cosine schedule, as a fraction of lr."""
